//! Direct access to the test bucket (`bucket` on moto or SeaweedFS), beside the store under
//! test: list, read, replace and delete objects, to inspect what the store wrote or damage it
//! on purpose. Included by the S3 tests that need it (`#[path = "support/raw.rs"] mod raw;`),
//! not by `support/mod.rs`, which the cli's tests include without these dependencies.
#![allow(dead_code)]

use futures::TryStreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, PutPayload};

use crate::support::S3Server;

pub struct Raw {
    runtime: tokio::runtime::Runtime,
    store: AmazonS3,
}

impl Raw {
    pub fn new(server: &(impl S3Server + ?Sized)) -> Raw {
        Raw::in_bucket(server, "bucket")
    }

    /// Direct access to bucket `bucket` of `server`.
    pub fn in_bucket(server: &(impl S3Server + ?Sized), bucket: &str) -> Raw {
        Raw {
            runtime: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
            store: AmazonS3Builder::new()
                .with_bucket_name(bucket)
                .with_endpoint(server.endpoint())
                .with_allow_http(true)
                .with_region("us-east-1")
                .with_access_key_id("testing")
                .with_secret_access_key("testing")
                .build()
                .unwrap(),
        }
    }

    /// (key, size) of every object under `prefix`, in key order.
    pub fn objects(&self, prefix: &str) -> Vec<(String, u64)> {
        let prefix = ObjectPath::from(prefix);
        let mut objects: Vec<(String, u64)> = self
            .runtime
            .block_on(self.store.list(Some(&prefix)).try_collect::<Vec<_>>())
            .unwrap()
            .into_iter()
            .map(|object| (object.location.to_string(), object.size))
            .collect();
        objects.sort();
        objects
    }

    /// Keys of every object under `prefix`, in key order.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        self.objects(prefix)
            .into_iter()
            .map(|(key, _)| key)
            .collect()
    }

    pub fn get(&self, key: &str) -> Vec<u8> {
        self.runtime
            .block_on(async {
                self.store
                    .get(&ObjectPath::from(key))
                    .await
                    .unwrap()
                    .bytes()
                    .await
            })
            .unwrap()
            .to_vec()
    }

    pub fn put(&self, key: &str, body: Vec<u8>) {
        self.runtime
            .block_on(
                self.store
                    .put(&ObjectPath::from(key), PutPayload::from(body)),
            )
            .unwrap();
    }

    pub fn delete(&self, key: &str) {
        self.runtime
            .block_on(self.store.delete(&ObjectPath::from(key)))
            .unwrap();
    }
}
