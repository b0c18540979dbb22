//! The prefetch thread: reads whole byte ranges (a layer's streamed attention and gate) into
//! buffers while the compute thread works on the layer before, and hands them back in the order
//! they were asked for. Buffers come back to it for reuse, so steady-state decoding allocates
//! nothing and first-touch page faults stay out of the timings.
//!
//! Jobs are read as one pipeline ([`crate::io::Reader::read_stream`]): a job's ranges are cut into
//! chunks that go to the reader in order, and the next job's chunks start as soon as it is
//! submitted, while the last ones of the job before are still in flight — with two or more jobs
//! queued the device never drains between layers.
//!
//! A job's ranges are laid out in its buffer either back to back ([`Placement::Packed`], mostly
//! copied there as they land) or each at its file offset's phase ([`Placement::InPhase`]), which lets the
//! reader put their whole blocks straight into the buffer ([`crate::io::Reader::read_into`]): no
//! copy on the host, and on a GPU, whose device page-locked the buffer, the reads land in
//! page-locked memory the copies to the device start from.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::Arc;

use crossbeam_channel::{unbounded, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::io::{in_phase_len_max, in_phase_starts, Range, Reader, StreamReq};

/// Writes the bytes kept free before a job's ranges (their leads), given the buffer and where
/// each range starts; run on the prefetch thread before the reads.
pub type Fill = Box<dyn FnOnce(&mut [u8], &[usize]) + Send>;

/// How a job's ranges are laid out in its buffer.
pub enum Placement {
    /// Back to back from the buffer's start, in the order given (most reads then copied out of
    /// the reader's buffers: a range's phase in the buffer is rarely its file offset's).
    Packed,
    /// In the order given, each at its file offset's phase ([`in_phase_starts`]; up to
    /// [`in_phase_len_max`] bytes) after `leads[i]` bytes kept free before it, read straight
    /// into the buffer where the reader can; `fill` writes those free bytes.
    InPhase { leads: Vec<usize>, fill: Option<Fill> },
}

impl Placement {
    /// In phase, nothing kept free.
    pub fn in_phase() -> Placement {
        Placement::InPhase {
            leads: Vec::new(),
            fill: None,
        }
    }
}

struct Job {
    key: usize,
    ranges: Vec<Range>,
    buf: Vec<u8>,
    placement: Placement,
}

/// A finished job: `buf` holds range i's bytes at `starts[i]`.
pub struct Done {
    pub key: usize,
    pub buf: Vec<u8>,
    pub starts: Vec<usize>,
    /// The ranges' bytes (what was asked for; the buffer may be longer).
    pub bytes: usize,
    pub result: Result<()>,
    pub read_time: Duration,
}

/// Lays `ranges` out in `buf` by `placement` (resized to fit) and writes its leads; returns where
/// each range starts and the layout's end.
fn lay_out(ranges: &[Range], buf: &mut Vec<u8>, placement: Placement) -> Vec<usize> {
    match placement {
        Placement::Packed => {
            let mut starts = Vec::with_capacity(ranges.len());
            let mut at = 0;
            for r in ranges {
                starts.push(at);
                at += r.len_bytes;
            }
            buf.resize(at, 0);
            starts
        }
        Placement::InPhase { leads, fill } => {
            // Sized first (a buffer made at its largest is not reallocated), then laid out for
            // the address it has.
            buf.resize(in_phase_len_max(ranges, &leads), 0);
            let (starts, _) = in_phase_starts(buf.as_ptr() as usize, ranges, &leads);
            if let Some(fill) = fill {
                fill(buf, &starts);
            }
            starts
        }
    }
}

/// A job being read: its chunks (a range each, and where it lands in `buf`) go to the reader in
/// order; it is done when every chunk issued has landed.
struct Active {
    job: Job,
    starts: Vec<usize>,
    chunks: Vec<(Range, usize)>,
    issued: usize,
    outstanding: usize,
    result: Result<()>,
    t0: Instant,
}

/// The prefetch thread's jobs in flight, oldest first; `first` is the sequence number of the
/// front one (a chunk's tag is its job's sequence number and index).
struct Queue {
    active: VecDeque<Active>,
    first: u64,
}

impl Queue {
    /// Hands finished jobs at the front to `done` (in submission order); false once the
    /// receiving side is gone.
    fn flush(&mut self, done_tx: &Sender<Done>) -> bool {
        while self
            .active
            .front()
            .is_some_and(|a| a.issued == a.chunks.len() && a.outstanding == 0)
        {
            let a = self.active.pop_front().expect("checked");
            self.first += 1;
            let done = Done {
                key: a.job.key,
                bytes: a.job.ranges.iter().map(|r| r.len_bytes).sum(),
                buf: a.job.buf,
                starts: a.starts,
                result: a.result,
                read_time: a.t0.elapsed(),
            };
            if done_tx.send(done).is_err() {
                return false;
            }
        }
        true
    }
}

/// The prefetch thread: reads jobs as they come, one pipeline of chunks through the reader
/// ([`Reader::read_stream`]), so the next job's reads start while the last chunks of the one
/// before are still in flight; finished jobs go back in submission order.
fn serve(reader: &dyn Reader, jobs: Receiver<Job>, done_tx: Sender<Done>, chunk_bytes: usize) {
    let q = RefCell::new(Queue {
        active: VecDeque::new(),
        first: 0,
    });
    let open = std::cell::Cell::new(true);
    let mut next = |idle: bool| -> Option<StreamReq> {
        let mut q = q.borrow_mut();
        loop {
            let seq = (q.first + q.active.len() as u64).saturating_sub(1);
            if let Some(a) = q.active.back_mut().filter(|a| a.issued < a.chunks.len()) {
                let (range, at) = a.chunks[a.issued];
                let tag = (seq << 32) | a.issued as u64;
                a.issued += 1;
                a.outstanding += 1;
                return Some(StreamReq {
                    offset_bytes: range.offset_bytes,
                    len_bytes: range.len_bytes,
                    // SAFETY: (pointer arithmetic) the chunk lies inside the job's buffer (laid
                    // out for its ranges, which the chunks split).
                    dest: unsafe { a.job.buf.as_mut_ptr().add(at) },
                    tag,
                });
            }
            if !open.get() {
                return None;
            }
            let job = match idle && q.active.is_empty() {
                true => jobs.recv().ok(),
                false => jobs.try_recv().ok(),
            };
            let Some(mut job) = job else {
                if idle && q.active.is_empty() {
                    open.set(false);
                }
                return None;
            };
            let placement = std::mem::replace(&mut job.placement, Placement::Packed);
            let starts = lay_out(&job.ranges, &mut job.buf, placement);
            let (chunks, places) = cut(&job.ranges, chunk_bytes);
            let chunks = chunks
                .into_iter()
                .zip(places.iter().map(|&(r, o)| starts[r] + o))
                .collect();
            q.active.push_back(Active {
                job,
                starts,
                chunks,
                issued: 0,
                outstanding: 0,
                result: Ok(()),
                t0: Instant::now(),
            });
            // A job with nothing to read is done at once.
            if !q.flush(&done_tx) {
                open.set(false);
            }
        }
    };
    let mut done = |tag: u64, result: Result<()>| {
        let mut q = q.borrow_mut();
        let i = ((tag >> 32) - q.first) as usize;
        let a = &mut q.active[i];
        a.outstanding -= 1;
        if let Err(e) = result {
            if a.result.is_ok() {
                a.result = Err(e);
            }
            // Nothing more of a failed job is read.
            a.issued = a.chunks.len();
        }
        if !q.flush(&done_tx) {
            open.set(false);
        }
    };
    // SAFETY: every request points into the buffer of a job held in `q` until each of its chunks
    // has reported to `done` (a job leaves `q` only in `flush`, once none is outstanding); no one
    // touches a job's buffer meanwhile (its fill ran before its first chunk was handed over).
    let streamed = unsafe { reader.read_stream(&mut next, &mut done) };
    if let Err(e) = streamed {
        // The reader broke: every job still here fails with its error.
        let mut q = q.borrow_mut();
        let msg = e.to_string();
        while let Some(a) = q.active.pop_front() {
            let _ = done_tx.send(Done {
                key: a.job.key,
                bytes: a.job.ranges.iter().map(|r| r.len_bytes).sum(),
                buf: a.job.buf,
                starts: a.starts,
                result: Err(Error::Device(format!("the prefetch thread's reader failed: {msg}"))),
                read_time: a.t0.elapsed(),
            });
        }
    }
}

/// `ranges` cut into reads of at most `chunk_bytes` (the readers' reusable buffer size, so no
/// read needs a one-off buffer), each with its place: (index of its range, offset in it).
pub(crate) fn cut(ranges: &[Range], chunk_bytes: usize) -> (Vec<Range>, Vec<(usize, usize)>) {
    let chunk_bytes = chunk_bytes.max(1);
    let (mut chunks, mut places) = (Vec::new(), Vec::new());
    for (i, r) in ranges.iter().enumerate() {
        let mut done = 0;
        while done < r.len_bytes {
            let len = chunk_bytes.min(r.len_bytes - done);
            chunks.push(Range::new(r.offset_bytes + done as u64, len));
            places.push((i, done));
            done += len;
        }
    }
    (chunks, places)
}

pub struct Prefetcher {
    jobs: Option<Sender<Job>>,
    done: Receiver<Done>,
    thread: Option<JoinHandle<()>>,
}

impl Prefetcher {
    /// `chunk_bytes`: reads are cut to at most this size (the reader's reusable buffer size),
    /// so no read needs a one-off buffer.
    pub fn start(reader: Arc<dyn Reader>, chunk_bytes: usize) -> Result<Prefetcher> {
        let chunk_bytes = chunk_bytes.max(1);
        let (job_tx, job_rx) = unbounded::<Job>();
        let (done_tx, done_rx) = unbounded::<Done>();
        let thread = std::thread::Builder::new()
            .name("gatestream-prefetch".into())
            .spawn(move || serve(reader.as_ref(), job_rx, done_tx, chunk_bytes))
            .map_err(|e| Error::Device(format!("cannot start the prefetch thread: {e}")))?;
        Ok(Prefetcher {
            jobs: Some(job_tx),
            done: done_rx,
            thread: Some(thread),
        })
    }

    /// Queues a read of `ranges` into `buf` (reused; resized as needed), laid out by `placement`.
    pub fn submit(&self, key: usize, ranges: Vec<Range>, buf: Vec<u8>, placement: Placement) -> Result<()> {
        self.jobs
            .as_ref()
            .expect("prefetcher running")
            .send(Job {
                key,
                ranges,
                buf,
                placement,
            })
            .map_err(|_| Error::Internal("the prefetch thread has stopped".into()))
    }

    /// The next finished job, in submission order (blocks until it is done).
    pub fn next(&self) -> Result<Done> {
        self.done
            .recv()
            .map_err(|_| Error::Internal("the prefetch thread has stopped".into()))
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
