//! Retries of PUT and DELETE whose connection broke: `object_store` retries a request whose
//! connection was reset or timed out after it was sent only when it considers the request
//! idempotent, which excludes create-only PUTs and DELETEs. Both are safe to repeat here: a
//! DELETE of a deleted object succeeds, and a repeated create-only PUT that the store had
//! carried out fails its condition (412), which every caller already handles (the lock reads
//! its own id back, an epoch claim recovers again, the lock probe expects it). So such
//! failures are reported to `object_store` as failures to send the request, which it retries
//! with its backoff until `retry-timeout-ms` like any other.

use async_trait::async_trait;
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpErrorKind, HttpRequest, HttpResponse, HttpService,
    ReqwestConnector,
};
use object_store::ClientOptions;

/// The reqwest connector, its clients wrapped in [`RetryWrites`].
#[derive(Debug, Default)]
pub(crate) struct RetryWritesConnector(ReqwestConnector);

impl HttpConnector for RetryWritesConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        Ok(HttpClient::new(RetryWrites(self.0.connect(options)?)))
    }
}

/// An HTTP client whose PUTs and DELETEs that were interrupted or timed out report an error
/// `object_store` retries (see the module docs).
#[derive(Debug)]
struct RetryWrites(HttpClient);

#[async_trait]
impl HttpService for RetryWrites {
    async fn call(&self, request: HttpRequest) -> Result<HttpResponse, HttpError> {
        let repeatable = matches!(request.method().as_str(), "PUT" | "DELETE");
        match self.0.execute(request).await {
            Err(error)
                if repeatable
                    && matches!(
                        error.kind(),
                        HttpErrorKind::Interrupted | HttpErrorKind::Timeout
                    ) =>
            {
                Err(HttpError::new(HttpErrorKind::Request, error))
            }
            outcome => outcome,
        }
    }
}
