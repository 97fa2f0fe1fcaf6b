#!/usr/bin/env python3
"""Gives a moto server a user whose credentials may read S3 but not write, and turns on
moto's IAM checks so that the policy is enforced.

usage: moto_read_only_user.py ENDPOINT
Creates the IAM user `reader` with an inline policy allowing only s3:GetObject and
s3:ListBucket, creates its access key, then POSTs 0 to /moto-api/reset-auth: from then on
moto checks every request's signature and policy (INITIAL_NO_AUTH_ACTION_COUNT = 0), so a
PUT or DELETE signed with the key is answered 403 AccessDenied. Prints the key as
"ACCESS_KEY_ID SECRET_ACCESS_KEY" on one line. Requests signed with keys moto does not know
(the tests' "testing") fail from then on; POST "inf" to /moto-api/reset-auth to turn the
checks off again.
"""
import json
import sys
import urllib.request

import boto3

endpoint = sys.argv[1]
iam = boto3.client(
    "iam",
    endpoint_url=endpoint,
    region_name="us-east-1",
    aws_access_key_id="testing",
    aws_secret_access_key="testing",
)
iam.create_user(UserName="reader")
policy = {
    "Version": "2012-10-17",
    "Statement": [
        {"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": "*"}
    ],
}
iam.put_user_policy(UserName="reader", PolicyName="read-only", PolicyDocument=json.dumps(policy))
key = iam.create_access_key(UserName="reader")["AccessKey"]
request = urllib.request.Request(
    endpoint + "/moto-api/reset-auth",
    data=b"0",
    method="POST",
    headers={"Content-Type": "text/plain"},
)
urllib.request.urlopen(request).read()
print(key["AccessKeyId"], key["SecretAccessKey"])
