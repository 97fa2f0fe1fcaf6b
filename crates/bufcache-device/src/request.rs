//! Requests a device may complete later: each owns its memory and its completion.
//!
//! A [`ReadRequest`] or [`WriteRequest`] carries an offset, the memory the bytes go to or come
//! from, and what runs when the device is done. The memory is owned by the request (a buffer,
//! or the cache's own buffer guards), so no borrow has to outlive a call and nobody promises a
//! lifetime by hand: the device works on the memory while it holds the request, and hands the
//! memory back to the completion, exactly once, when the request ends.
//!
//! Invariants:
//! - a request completes exactly once: with the device's outcome through
//!   [`Request::complete`], or with an error if it is dropped unfinished;
//! - the memory's length is fixed when the request is made ([`Request::length_bytes`]);
//! - hooks added by wrappers ([`Request::on_complete`]) run before the maker's completion,
//!   the last added first (the wrapper device nearest the real device), and each may change
//!   the outcome the next one sees.

use std::io::{self, IoSlice, IoSliceMut};

use crate::aligned::AlignedBytes;

/// Memory a read fills: slices, in order, that receive consecutive bytes.
pub trait ReadMemory: Send + 'static {
    /// The memory as slices, in order. Called any number of times; always the same memory.
    fn slices_mut(&mut self) -> Vec<IoSliceMut<'_>>;
}

/// Memory a write drains: slices, in order, whose bytes go to consecutive device bytes.
pub trait WriteMemory: Send + 'static {
    /// The memory as slices, in order. Called any number of times; always the same bytes.
    fn slices(&self) -> Vec<IoSlice<'_>>;
}

impl ReadMemory for Vec<u8> {
    fn slices_mut(&mut self) -> Vec<IoSliceMut<'_>> {
        vec![IoSliceMut::new(self)]
    }
}

impl WriteMemory for Vec<u8> {
    fn slices(&self) -> Vec<IoSlice<'_>> {
        vec![IoSlice::new(self)]
    }
}

impl ReadMemory for AlignedBytes {
    fn slices_mut(&mut self) -> Vec<IoSliceMut<'_>> {
        vec![IoSliceMut::new(self)]
    }
}

impl WriteMemory for AlignedBytes {
    fn slices(&self) -> Vec<IoSlice<'_>> {
        vec![IoSlice::new(self)]
    }
}

impl ReadMemory for Vec<Vec<u8>> {
    fn slices_mut(&mut self) -> Vec<IoSliceMut<'_>> {
        self.iter_mut().map(|part| IoSliceMut::new(part)).collect()
    }
}

impl WriteMemory for Vec<Vec<u8>> {
    fn slices(&self) -> Vec<IoSlice<'_>> {
        self.iter().map(|part| IoSlice::new(part)).collect()
    }
}

/// The erased state of one request: its memory (as `M`, a `dyn` memory trait) and what runs
/// when it ends.
trait State<M: ?Sized>: Send {
    fn memory(&mut self) -> &mut M;
    fn memory_shared(&self) -> &M;
    fn complete(self: Box<Self>, result: io::Result<()>);
}

/// A request as its maker built it: typed memory, handed back to the typed completion.
struct Owned<T, F: FnOnce(T, io::Result<()>)> {
    memory: Option<T>,
    done: Option<F>,
}

impl<T, F> Owned<T, F>
where
    F: FnOnce(T, io::Result<()>),
{
    fn finish(&mut self, result: io::Result<()>) {
        if let (Some(memory), Some(done)) = (self.memory.take(), self.done.take()) {
            done(memory, result);
        }
    }
}

impl<T, F> Drop for Owned<T, F>
where
    F: FnOnce(T, io::Result<()>),
{
    fn drop(&mut self) {
        self.finish(Err(dropped()));
    }
}

impl<T, F> State<dyn ReadMemory> for Owned<T, F>
where
    T: ReadMemory,
    F: FnOnce(T, io::Result<()>) + Send,
{
    fn memory(&mut self) -> &mut (dyn ReadMemory + 'static) {
        self.memory
            .as_mut()
            .expect("memory is held until completion")
    }
    fn memory_shared(&self) -> &(dyn ReadMemory + 'static) {
        self.memory
            .as_ref()
            .expect("memory is held until completion")
    }
    fn complete(mut self: Box<Self>, result: io::Result<()>) {
        self.finish(result);
    }
}

impl<T, F> State<dyn WriteMemory> for Owned<T, F>
where
    T: WriteMemory,
    F: FnOnce(T, io::Result<()>) + Send,
{
    fn memory(&mut self) -> &mut (dyn WriteMemory + 'static) {
        self.memory
            .as_mut()
            .expect("memory is held until completion")
    }
    fn memory_shared(&self) -> &(dyn WriteMemory + 'static) {
        self.memory
            .as_ref()
            .expect("memory is held until completion")
    }
    fn complete(mut self: Box<Self>, result: io::Result<()>) {
        self.finish(result);
    }
}

/// What a wrapper runs before the completion it wraps; it may change the outcome.
type Hook = Box<dyn FnOnce(io::Result<()>) -> io::Result<()> + Send>;

/// A request with a wrapper's hook in front of its completion.
struct Hooked<M: ?Sized> {
    inner: Option<Box<dyn State<M>>>,
    hook: Option<Hook>,
}

impl<M: ?Sized> State<M> for Hooked<M> {
    fn memory(&mut self) -> &mut M {
        self.inner
            .as_mut()
            .expect("the inner request is held until completion")
            .memory()
    }
    fn memory_shared(&self) -> &M {
        self.inner
            .as_ref()
            .expect("the inner request is held until completion")
            .memory_shared()
    }
    fn complete(mut self: Box<Self>, result: io::Result<()>) {
        let hook = self.hook.take().expect("a request completes once");
        let inner = self.inner.take().expect("a request completes once");
        inner.complete(hook(result));
    }
}

impl<M: ?Sized> Drop for Hooked<M> {
    fn drop(&mut self) {
        // Dropped unfinished: the hook still sees the failure (a counting wrapper counts it),
        // then the inner request completes with it as it drops.
        if let Some(hook) = self.hook.take() {
            let _ = hook(Err(dropped()));
        }
    }
}

fn dropped() -> io::Error {
    io::Error::other("the request was dropped before it was done")
}

/// One device request: an offset, owned memory (`M` is `dyn ReadMemory` or `dyn WriteMemory`)
/// and a completion that runs exactly once. See [`ReadRequest`] and [`WriteRequest`].
pub struct Request<M: ?Sized> {
    offset: u64,
    length_bytes: u64,
    state: Box<dyn State<M>>,
}

/// A read a device fills, now or later, then completes.
pub type ReadRequest = Request<dyn ReadMemory>;

/// A write a device drains, now or later, then completes.
pub type WriteRequest = Request<dyn WriteMemory>;

impl<M: ?Sized + 'static> Request<M> {
    /// The device byte offset of the first byte.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Total bytes the request moves.
    pub fn length_bytes(&self) -> u64 {
        self.length_bytes
    }

    /// Ends the request with `result`: hooks run, then the maker's completion, which gets its
    /// memory back.
    pub fn complete(self, result: io::Result<()>) {
        self.state.complete(result);
    }

    /// Runs `hook` with the outcome before the completion, passing on what it returns: how a
    /// wrapper device counts, or fails, a request it forwards.
    pub fn on_complete(
        self,
        hook: impl FnOnce(io::Result<()>) -> io::Result<()> + Send + 'static,
    ) -> Self {
        Request {
            offset: self.offset,
            length_bytes: self.length_bytes,
            state: Box::new(Hooked {
                inner: Some(self.state),
                hook: Some(Box::new(hook)),
            }),
        }
    }
}

impl ReadRequest {
    /// A read of the bytes at `offset` into `memory`; `done` gets the memory back with the
    /// outcome.
    pub fn new<T, F>(offset: u64, mut memory: T, done: F) -> Self
    where
        T: ReadMemory,
        F: FnOnce(T, io::Result<()>) + Send + 'static,
    {
        let length_bytes = memory
            .slices_mut()
            .iter()
            .map(|slice| slice.len() as u64)
            .sum();
        Request {
            offset,
            length_bytes,
            state: Box::new(Owned {
                memory: Some(memory),
                done: Some(done),
            }),
        }
    }

    /// The memory to fill, as slices in order.
    pub fn slices_mut(&mut self) -> Vec<IoSliceMut<'_>> {
        self.state.memory().slices_mut()
    }
}

impl WriteRequest {
    /// A write of `memory` at `offset`; `done` gets the memory back with the outcome.
    pub fn new<T, F>(offset: u64, memory: T, done: F) -> Self
    where
        T: WriteMemory,
        F: FnOnce(T, io::Result<()>) + Send + 'static,
    {
        let length_bytes = memory.slices().iter().map(|slice| slice.len() as u64).sum();
        Request {
            offset,
            length_bytes,
            state: Box::new(Owned {
                memory: Some(memory),
                done: Some(done),
            }),
        }
    }

    /// The bytes to write, as slices in order.
    pub fn slices(&self) -> Vec<IoSlice<'_>> {
        self.state.memory_shared().slices()
    }
}

/// A write request is the memory of another: a wrapper device that must see a write's
/// outcome before the write completes (to send it again on a new connection) makes a request
/// over it, and gets it back, unfinished, in that request's completion.
impl WriteMemory for WriteRequest {
    fn slices(&self) -> Vec<IoSlice<'_>> {
        self.state.memory_shared().slices()
    }
}

impl<M: ?Sized> std::fmt::Debug for Request<M> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Request")
            .field("offset", &self.offset)
            .field("length_bytes", &self.length_bytes)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn a_request_completes_once_with_its_memory_and_hooks_run_first() {
        // Goal: the completion gets the memory back exactly once, after every hook, the last
        // added first, and a hook's outcome is what the next one sees. Method: record the
        // order of calls through two hooks, the first added of which fails the request.
        let order = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&order);
        let request = WriteRequest::new(4096, vec![7u8; 512], move |memory: Vec<u8>, result| {
            seen.lock()
                .unwrap()
                .push(format!("done {} {}", memory.len(), result.is_ok()));
        });
        let first = Arc::clone(&order);
        let request = request.on_complete(move |result| {
            first.lock().unwrap().push("first added".to_string());
            result.and(Err(io::Error::other("failed below")))
        });
        let second = Arc::clone(&order);
        let request = request.on_complete(move |result| {
            second.lock().unwrap().push("last added".to_string());
            result
        });
        assert_eq!((request.offset(), request.length_bytes()), (4096, 512));
        request.complete(Ok(()));
        assert_eq!(
            *order.lock().unwrap(),
            ["last added", "first added", "done 512 false"]
        );
    }

    #[test]
    fn a_dropped_request_completes_with_an_error() {
        // Goal: a device that loses a request still ends it, so its maker never waits
        // forever. Method: drop a hooked read unfinished and look at what both saw.
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&outcomes);
        let read = ReadRequest::new(0, vec![0u8; 8], move |_memory: Vec<u8>, result| {
            seen.lock().unwrap().push(("done", result.is_err()));
        });
        let hooked = Arc::clone(&outcomes);
        let read = read.on_complete(move |result| {
            hooked.lock().unwrap().push(("hook", result.is_err()));
            result
        });
        drop(read);
        assert_eq!(*outcomes.lock().unwrap(), [("hook", true), ("done", true)]);
    }
}
