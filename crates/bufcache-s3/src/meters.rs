//! What a disk asks of its object store, counted in one place: an HTTP connector wrapped
//! around the `object_store` client's own ([`CountingConnector`]), so every request — data,
//! lock, metadata, checkpoints, the collector's, each retry — passes one counter, and no
//! layout code counts anything. Read as a [`StoreStats`] snapshot.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpRequest, HttpResponse, HttpService,
};
use object_store::ClientOptions;

/// The request kinds counted, as labelled: LIST is a GET of the bucket with `list-type=`.
pub const STORE_METHODS: [&str; 6] = ["GET", "PUT", "DELETE", "HEAD", "LIST", "POST"];
/// How a request ended, as labelled: `ok` (2xx, 3xx), `client_error` (4xx: a missing object,
/// a refused create-only PUT, refused credentials), `server_error` (5xx), `transport_error`
/// (no answer: connection refused or reset, timeout).
pub const STORE_OUTCOMES: [&str; 4] = ["ok", "client_error", "server_error", "transport_error"];
/// Upper bounds (seconds) of the request-duration histogram's buckets; a last bucket counts
/// the rest.
pub const STORE_DURATION_BUCKETS_SECONDS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

const METHOD_COUNT: usize = STORE_METHODS.len();
const OUTCOME_COUNT: usize = STORE_OUTCOMES.len();
const BUCKET_COUNT: usize = STORE_DURATION_BUCKETS_SECONDS.len() + 1;

/// The counters one disk's requests update.
#[derive(Debug, Default)]
pub struct StoreMeters {
    requests: [[AtomicU64; OUTCOME_COUNT]; METHOD_COUNT],
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    retries: AtomicU64,
    in_flight: AtomicU64,
    duration_buckets: [[AtomicU64; BUCKET_COUNT]; METHOD_COUNT],
    duration_nanoseconds: [AtomicU64; METHOD_COUNT],
}

/// A snapshot of [`StoreMeters`], indexed like [`STORE_METHODS`], [`STORE_OUTCOMES`] and
/// [`STORE_DURATION_BUCKETS_SECONDS`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StoreStats {
    /// Requests by method and outcome.
    pub requests: [[u64; OUTCOME_COUNT]; METHOD_COUNT],
    /// Request bodies sent.
    pub bytes_sent: u64,
    /// Response bodies received (their Content-Length).
    pub bytes_received: u64,
    /// Attempts that ended in an answer the client retries (5xx, 429) or without an answer:
    /// each is repeated until `retry-timeout-ms` has passed, so all but a request's last
    /// failure were retried.
    pub retries: u64,
    /// Requests sent and not yet answered.
    pub in_flight: u64,
    /// Request durations (until the answer's headers) per method, per bucket (not
    /// cumulative; the last bucket is the rest).
    pub duration_buckets: [[u64; BUCKET_COUNT]; METHOD_COUNT],
    /// Sum of the durations per method, in seconds.
    pub duration_seconds_sum: [f64; METHOD_COUNT],
    /// The log layout's store figures; None for the chunk layout.
    pub log: Option<LogStoreStats>,
}

/// The log layout's figures: what its objects hold and what the collector did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogStoreStats {
    /// Bytes of the disk the index maps to stored data.
    pub live_bytes: u64,
    /// Object bytes of the durable segments that no mapping points at (overwritten,
    /// trimmed, padding): what garbage collection can reclaim.
    pub garbage_bytes: u64,
    /// Durable segment objects.
    pub segments: u64,
    /// Collector rounds, whether or not they found anything to rewrite or delete.
    pub gc_passes: u64,
    /// Live bytes the collector copied to new segments.
    pub gc_bytes_moved: u64,
}

impl StoreMeters {
    pub fn new() -> Arc<StoreMeters> {
        Arc::new(StoreMeters::default())
    }

    pub fn stats(&self) -> StoreStats {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        StoreStats {
            requests: self.requests.each_ref().map(|row| row.each_ref().map(load)),
            bytes_sent: load(&self.bytes_sent),
            bytes_received: load(&self.bytes_received),
            retries: load(&self.retries),
            in_flight: load(&self.in_flight),
            duration_buckets: self
                .duration_buckets
                .each_ref()
                .map(|row| row.each_ref().map(load)),
            duration_seconds_sum: self
                .duration_nanoseconds
                .each_ref()
                .map(|sum| load(sum) as f64 / 1e9),
            log: None,
        }
    }

    fn record(&self, method: usize, outcome: usize, seconds: f64, received: u64) {
        self.requests[method][outcome].fetch_add(1, Ordering::Relaxed);
        self.bytes_received.fetch_add(received, Ordering::Relaxed);
        let bucket = STORE_DURATION_BUCKETS_SECONDS
            .iter()
            .position(|&bound| seconds <= bound)
            .unwrap_or(BUCKET_COUNT - 1);
        self.duration_buckets[method][bucket].fetch_add(1, Ordering::Relaxed);
        self.duration_nanoseconds[method].fetch_add((seconds * 1e9) as u64, Ordering::Relaxed);
    }
}

/// The method label of a request: LIST for a GET of the bucket listing.
fn method_index(request: &HttpRequest) -> usize {
    let name = match request.method().as_str() {
        "GET"
            if request
                .uri()
                .query()
                .is_some_and(|query| query.contains("list-type=")) =>
        {
            "LIST"
        }
        other => other,
    };
    STORE_METHODS
        .iter()
        .position(|&known| known == name)
        .unwrap_or(STORE_METHODS.len() - 1)
}

/// The `object_store` client's HTTP connector with every request counted in `meters`, over
/// the connector that makes broken PUTs and DELETEs retryable (module `retry_writes`).
#[derive(Debug)]
pub struct CountingConnector {
    meters: Arc<StoreMeters>,
}

impl CountingConnector {
    /// A connector counting every request of the clients it makes in `meters`.
    pub fn new(meters: Arc<StoreMeters>) -> CountingConnector {
        CountingConnector { meters }
    }
}

impl HttpConnector for CountingConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        let inner = crate::retry_writes::RetryWritesConnector::default().connect(options)?;
        Ok(HttpClient::new(CountingService {
            inner,
            meters: Arc::clone(&self.meters),
        }))
    }
}

#[derive(Debug)]
struct CountingService {
    inner: HttpClient,
    meters: Arc<StoreMeters>,
}

/// Takes one request off the in-flight gauge when dropped, so a cancelled request (its
/// future dropped) does not stay counted.
struct InFlight<'a>(&'a AtomicU64);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[async_trait::async_trait]
impl HttpService for CountingService {
    async fn call(&self, request: HttpRequest) -> Result<HttpResponse, HttpError> {
        let meters = &self.meters;
        let method = method_index(&request);
        meters
            .bytes_sent
            .fetch_add(request.body().content_length() as u64, Ordering::Relaxed);
        meters.in_flight.fetch_add(1, Ordering::Relaxed);
        let _in_flight = InFlight(&meters.in_flight);
        let started = Instant::now();
        let answer = self.inner.execute(request).await;
        let seconds = started.elapsed().as_secs_f64();
        let (outcome, received, retried) = match &answer {
            Ok(response) => {
                let status = response.status();
                let received = response
                    .headers()
                    .get(http_content_length())
                    .and_then(|value| value.to_str().ok())
                    .and_then(|text| text.parse().ok())
                    .unwrap_or(0);
                let outcome = if status.is_server_error() {
                    2
                } else if status.is_client_error() {
                    1
                } else {
                    0
                };
                (
                    outcome,
                    received,
                    status.is_server_error() || status.as_u16() == 429,
                )
            }
            Err(_) => (3, 0, true),
        };
        if retried {
            meters.retries.fetch_add(1, Ordering::Relaxed);
        }
        meters.record(method, outcome, seconds, received);
        answer
    }
}

fn http_content_length() -> &'static str {
    "content-length"
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(method: &str, uri: &str) -> HttpRequest {
        let mut request = HttpRequest::new(Vec::<u8>::new().into());
        *request.method_mut() = method.parse().unwrap();
        *request.uri_mut() = uri.parse().unwrap();
        request
    }

    // Goal: each request lands under its method's label, a bucket listing under LIST, and its
    // duration in the first bucket whose bound holds it (the last one past every bound).
    // Method: label requests of each kind, record three durations and read the snapshot.
    #[test]
    fn requests_are_labelled_by_method_and_durations_bucketed_by_bound() {
        let label = |method: &str, uri: &str| STORE_METHODS[method_index(&request(method, uri))];
        assert_eq!(label("GET", "http://h/b/disk/chunks/0"), "GET");
        assert_eq!(label("GET", "http://h/b?list-type=2&prefix=disk"), "LIST");
        assert_eq!(label("PUT", "http://h/b/disk/bufcache-lock.json"), "PUT");
        assert_eq!(label("DELETE", "http://h/b/k"), "DELETE");
        assert_eq!(label("HEAD", "http://h/b/k"), "HEAD");
        let meters = StoreMeters::new();
        meters.record(0, 0, 0.0005, 10);
        meters.record(0, 1, 0.003, 0);
        meters.record(1, 2, 60.0, 0);
        let stats = meters.stats();
        assert_eq!(stats.requests[0], [1, 1, 0, 0]);
        assert_eq!(stats.requests[1], [0, 0, 1, 0]);
        assert_eq!(stats.duration_buckets[0][0], 1, "0.5 ms: ≤ 1 ms");
        assert_eq!(stats.duration_buckets[0][2], 1, "3 ms: ≤ 5 ms");
        assert_eq!(
            stats.duration_buckets[1][BUCKET_COUNT - 1],
            1,
            "60 s: past 10 s"
        );
        assert_eq!(stats.bytes_received, 10);
        assert!((stats.duration_seconds_sum[1] - 60.0).abs() < 1e-6);
    }
}
