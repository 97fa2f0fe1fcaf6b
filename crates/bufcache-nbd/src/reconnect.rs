//! An upstream NBD device that survives the upstream server restarting.
//!
//! [`ReconnectingClient`] wraps [`NbdClient`]: when the connection is lost, the request fails
//! (the cache keeps its dirty data and retries write-back later) and the next requests try to
//! connect again, with exponential backoff between attempts (`delay_initial` doubling up to
//! `delay_max`) for up to `give_up_after`. While disconnected every request fails at once —
//! FLUSH included, so nothing is ever reported durable that is not — and after a reconnect
//! requests go to the new connection. A new upstream whose export size differs from the first
//! is refused with an error naming both sizes.
//!
//! Writes acknowledged by the lost connection but not yet flushed by it may not have reached
//! stable storage there, so the first FLUSH after a reconnect that follows such writes fails
//! (the error is reported once, like a write-back error).

use std::io::{self, IoSlice, IoSliceMut};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bufcache_device::write_and_wait;
use bufcache_device::{Capabilities, Device, Extent, ReadRequest, WriteRequest};
use parking_lot::Mutex;

use crate::client::{ClientError, NbdClient};

/// How a [`ReconnectingClient`] retries.
#[derive(Debug, Clone, Copy)]
pub struct ReconnectPolicy {
    /// Wait before the second attempt; doubles after each failed attempt.
    pub delay_initial: Duration,
    /// The longest wait between attempts.
    pub delay_max: Duration,
    /// Stop attempting after the upstream has been unreachable this long (zero: never stop).
    pub give_up_after: Duration,
}

impl Default for ReconnectPolicy {
    fn default() -> Self {
        ReconnectPolicy {
            delay_initial: Duration::from_millis(100),
            delay_max: Duration::from_secs(5),
            give_up_after: Duration::from_secs(3600),
        }
    }
}

struct State {
    current: Option<Arc<NbdClient>>,
    down_since: Option<Instant>,
    next_attempt: Instant,
    delay: Duration,
    /// Writes acknowledged on the current connection since its last successful flush.
    unflushed_writes: bool,
    /// A connection with unflushed writes was lost: the next flush must fail.
    unflushed_lost: bool,
    last_failure: String,
}

/// An NBD upstream device that reconnects (see the module documentation).
pub struct ReconnectingClient {
    uri: String,
    policy: ReconnectPolicy,
    /// Fixed at the first connection; a later upstream must match it.
    capabilities: Capabilities,
    state: Mutex<State>,
    connected: AtomicBool,
    reconnects: AtomicU64,
}

impl ReconnectingClient {
    /// Writes a batch on the current connection, retrying once on a new one the writes that
    /// connection lost; each write comes back with its outcome, unfinished, for the caller to
    /// complete once every attempt is over (so no write is acknowledged before the
    /// connection it went to is known to need a FLUSH).
    fn write_batch(&self, writes: Vec<WriteRequest>) -> Vec<(WriteRequest, io::Result<()>)> {
        let client = match self.client() {
            Ok(client) => client,
            Err(error) => {
                return writes
                    .into_iter()
                    .map(|write| (write, Err(copy_error(&error))))
                    .collect();
            }
        };
        let mut outcomes = self.write_on(&client, writes);
        let lost: Vec<usize> = (0..outcomes.len())
            .filter(|&position| outcomes[position].1.as_ref().is_err_and(is_disconnect))
            .collect();
        let Some(&first) = lost.first() else {
            return outcomes;
        };
        if let Err(error) = &outcomes[first].1 {
            self.lost(&client, error);
        }
        let Ok(client) = self.client() else {
            return outcomes;
        };
        // Taken out in reverse so the positions of the ones not yet taken stay put.
        let mut retry: Vec<(usize, WriteRequest)> = lost
            .iter()
            .rev()
            .map(|&position| (position, outcomes.remove(position).0))
            .collect();
        retry.reverse();
        let (positions, writes): (Vec<usize>, Vec<WriteRequest>) = retry.into_iter().unzip();
        let retried = self.write_on(&client, writes);
        for (_, result) in &retried {
            if let Err(error) = result {
                if is_disconnect(error) {
                    self.lost(&client, error);
                }
            }
        }
        for (position, outcome) in positions.into_iter().zip(retried) {
            outcomes.insert(position, outcome);
        }
        outcomes
    }

    /// Writes a batch on `client` and waits for every write, each carried as the memory of a
    /// request of its own so it comes back unfinished with its outcome.
    fn write_on(
        &self,
        client: &NbdClient,
        writes: Vec<WriteRequest>,
    ) -> Vec<(WriteRequest, io::Result<()>)> {
        let carried = writes
            .into_iter()
            .map(|write| (write.offset(), write))
            .collect();
        let outcomes = write_and_wait(client, carried);
        // Writes this connection acknowledged need a FLUSH on it: say so before a loss is
        // recorded, so that the loss marks them as possibly not durable.
        if outcomes.iter().any(|(_, result)| result.is_ok()) {
            self.wrote();
        }
        outcomes
    }

    /// Connects for the first time; failing here is an error (there is no size to serve yet).
    pub fn connect(uri: &str, policy: ReconnectPolicy) -> Result<ReconnectingClient, ClientError> {
        let client = NbdClient::connect(uri)?;
        Ok(ReconnectingClient {
            uri: uri.to_string(),
            policy,
            capabilities: client.capabilities(),
            state: Mutex::new(State {
                current: Some(Arc::new(client)),
                down_since: None,
                next_attempt: Instant::now(),
                delay: policy.delay_initial,
                unflushed_writes: false,
                unflushed_lost: false,
                last_failure: String::new(),
            }),
            connected: AtomicBool::new(true),
            reconnects: AtomicU64::new(0),
        })
    }

    /// True while a connection is up.
    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }

    /// Successful reconnections so far.
    pub fn reconnect_count(&self) -> u64 {
        self.reconnects.load(Ordering::Acquire)
    }

    /// The current connection, connecting again if it is down and an attempt is due.
    fn client(&self) -> io::Result<Arc<NbdClient>> {
        let mut state = self.state.lock();
        if let Some(client) = &state.current {
            return Ok(Arc::clone(client));
        }
        let now = Instant::now();
        let down_since = *state.down_since.get_or_insert(now);
        let down_for = now.duration_since(down_since);
        if !self.policy.give_up_after.is_zero() && down_for >= self.policy.give_up_after {
            return Err(self.down_error(&format!(
                "gave up reconnecting after {:.0} s (last failure: {})",
                down_for.as_secs_f64(),
                state.last_failure
            )));
        }
        if now < state.next_attempt {
            return Err(self.down_error(&format!(
                "disconnected for {:.1} s, next attempt in {:.1} s (last failure: {})",
                down_for.as_secs_f64(),
                state.next_attempt.duration_since(now).as_secs_f64(),
                state.last_failure
            )));
        }
        let attempt = NbdClient::connect(&self.uri).map_err(|error| error.to_string());
        let attempt = attempt.and_then(|client| {
            if client.size() == self.capabilities.length_bytes {
                Ok(client)
            } else {
                Err(format!(
                    "the upstream came back with a different size: {} bytes, was {} bytes; \
                     refusing it (the cached data belongs to the old disk)",
                    client.size(),
                    self.capabilities.length_bytes
                ))
            }
        });
        match attempt {
            Ok(client) => {
                let client = Arc::new(client);
                state.current = Some(Arc::clone(&client));
                state.down_since = None;
                state.delay = self.policy.delay_initial;
                state.unflushed_writes = false;
                self.connected.store(true, Ordering::Release);
                self.reconnects.fetch_add(1, Ordering::AcqRel);
                tracing::warn!(upstream = %self.uri, down_s = down_for.as_secs_f64(), "upstream reconnected");
                Ok(client)
            }
            Err(reason) => {
                tracing::warn!(upstream = %self.uri, "upstream reconnect failed: {reason}");
                state.last_failure = reason.clone();
                state.next_attempt = now + state.delay;
                state.delay = (state.delay * 2).min(self.policy.delay_max);
                Err(self.down_error(&reason))
            }
        }
    }

    fn down_error(&self, reason: &str) -> io::Error {
        io::Error::new(
            io::ErrorKind::NotConnected,
            format!("{}: upstream unavailable: {reason}", self.uri),
        )
    }

    /// Runs `operation` on the current connection; a lost connection is noted (and one
    /// immediate reconnect attempted, retrying the operation once on the new connection).
    fn run<T>(&self, operation: impl Fn(&NbdClient) -> io::Result<T>) -> io::Result<T> {
        let client = self.client()?;
        match operation(&client) {
            Err(error) if is_disconnect(&error) => {
                self.lost(&client, &error);
                let client = self.client()?;
                let result = operation(&client);
                if let Err(error) = &result {
                    if is_disconnect(error) {
                        self.lost(&client, error);
                    }
                }
                result
            }
            result => result,
        }
    }

    fn lost(&self, client: &Arc<NbdClient>, error: &io::Error) {
        let mut state = self.state.lock();
        let is_current = state
            .current
            .as_ref()
            .is_some_and(|current| Arc::ptr_eq(current, client));
        if !is_current {
            return;
        }
        tracing::warn!(upstream = %self.uri, "upstream connection lost: {error}");
        state.current = None;
        state.down_since = Some(Instant::now());
        state.next_attempt = Instant::now();
        state.delay = self.policy.delay_initial;
        state.last_failure = error.to_string();
        if state.unflushed_writes {
            state.unflushed_lost = true;
        }
        self.connected.store(false, Ordering::Release);
    }

    fn wrote(&self) {
        self.state.lock().unflushed_writes = true;
    }
}

/// The same error again, for a second caller (io::Error is not Clone).
fn copy_error(error: &io::Error) -> io::Error {
    io::Error::new(error.kind(), error.to_string())
}

/// True for errors that mean the connection is gone (not a refused request).
fn is_disconnect(error: &io::Error) -> bool {
    match error
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<ClientError>())
    {
        Some(ClientError::Disconnected { .. }) => true,
        Some(_) => false,
        None => matches!(
            error.kind(),
            io::ErrorKind::BrokenPipe
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::UnexpectedEof
        ),
    }
}

impl Device for ReconnectingClient {
    fn read_vectored_at(&self, buffers: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<()> {
        // The buffers are reborrowed per attempt: a failed attempt may have filled part.
        let client = self.client()?;
        match client.read_vectored_at(buffers, offset) {
            Err(error) if is_disconnect(&error) => {
                self.lost(&client, &error);
                let client = self.client()?;
                client.read_vectored_at(buffers, offset)
            }
            result => result,
        }
    }

    fn write_vectored_at(&self, buffers: &[IoSlice<'_>], offset: u64) -> io::Result<()> {
        self.run(|client| client.write_vectored_at(buffers, offset))?;
        self.wrote();
        Ok(())
    }

    /// The batch goes to the current connection whole, and each write completes before this
    /// returns: writes that failed because that connection was lost are retried once,
    /// together, on a new one (as [`Self::run`] does for a single request); writes that
    /// succeeded are not sent again.
    fn submit_writes(&self, writes: Vec<WriteRequest>) {
        for (write, result) in self.write_batch(writes) {
            write.complete(result);
        }
    }

    /// Started on the current connection when there is one. Without one they fail at once
    /// rather than reconnect here, in the thread that started them (which is reading a
    /// client's requests): the caller serves a failed started read again synchronously,
    /// which is where reconnecting happens, as it does for a read the connection fails
    /// while in flight.
    fn submit_reads(&self, reads: Vec<ReadRequest>) {
        let current = self.state.lock().current.clone();
        match current {
            Some(client) => client.submit_reads(reads),
            None => {
                for read in reads {
                    read.complete(Err(self.down_error("not connected; reconnecting")));
                }
            }
        }
    }

    fn flush(&self) -> io::Result<()> {
        let client = self.client()?;
        {
            let mut state = self.state.lock();
            if state.unflushed_lost {
                state.unflushed_lost = false;
                return Err(io::Error::other(format!(
                    "{}: the upstream connection was lost before writes it acknowledged were \
                     flushed; they may not have reached stable storage",
                    self.uri
                )));
            }
        }
        match Device::flush(&*client) {
            Ok(()) => {
                let mut state = self.state.lock();
                if state
                    .current
                    .as_ref()
                    .is_some_and(|current| Arc::ptr_eq(current, &client))
                {
                    state.unflushed_writes = false;
                }
                Ok(())
            }
            Err(error) => {
                if is_disconnect(&error) {
                    self.lost(&client, &error);
                }
                Err(error)
            }
        }
    }

    fn discard(&self, offset: u64, length: u64) -> io::Result<()> {
        self.run(|client| client.discard(offset, length))?;
        self.wrote();
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        self.run(|client| client.write_zeroes(offset, length))?;
        self.wrote();
        Ok(())
    }

    fn extents(&self, offset: u64, length: u64) -> io::Result<Vec<Extent>> {
        self.run(|client| client.extents(offset, length))
    }

    fn capabilities(&self) -> Capabilities {
        self.capabilities
    }

    fn describe(&self) -> String {
        self.uri.clone()
    }
}
