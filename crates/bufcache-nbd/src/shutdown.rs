//! [`ShutdownHandle`]: the flag that stops a server, seen by its accept loop, its handshakes
//! (which then answer `NBD_REP_ERR_SHUTDOWN`) and its connections (which answer ESHUTDOWN).
//! A module of its own so the handshake and transmission modules need not import the server.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Tells a running server to stop. Cheap to clone; every clone controls the same server.
#[derive(Clone, Debug, Default)]
pub struct ShutdownHandle {
    triggered: Arc<AtomicBool>,
}

impl ShutdownHandle {
    pub fn new() -> Self {
        ShutdownHandle::default()
    }

    /// Asks the server to stop accepting, finish in-flight requests and return from `run`.
    pub fn trigger(&self) {
        self.triggered.store(true, Ordering::Release);
    }

    pub fn is_triggered(&self) -> bool {
        self.triggered.load(Ordering::Acquire)
    }
}
