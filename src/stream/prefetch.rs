//! The prefetch thread: reads whole byte ranges (a layer's streamed attention and gate) into
//! buffers while the compute thread works on the layer before, and hands them back in the order
//! they were asked for. Buffers come back to it for reuse, so steady-state decoding allocates
//! nothing and first-touch page faults stay out of the timings.
//!
//! A job's ranges are laid out in its buffer either back to back ([`Placement::Packed`], mostly
//! copied there as they land) or each at its file offset's phase ([`Placement::InPhase`]), which lets the
//! reader put their whole blocks straight into the buffer ([`crate::io::Reader::read_into`]): no
//! copy on the host, and on a GPU, whose device page-locked the buffer, the reads land in
//! page-locked memory the copies to the device start from.

use std::sync::Arc;

use crossbeam_channel::{unbounded, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::io::{in_phase_len_max, in_phase_starts, requests_at, Range, Reader};

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

/// Reads `ranges` into `buf` laid out by `placement` (resized to fit), cut into reads of at most
/// `chunk_bytes`; returns where each range starts. One read path for both layouts: the reader
/// fills the chunks' slices (io_uring in place wherever a slice has its file offset's phase,
/// which the in-phase layout gives every range).
fn read_job(
    reader: &dyn Reader,
    ranges: &[Range],
    buf: &mut Vec<u8>,
    placement: Placement,
    chunk_bytes: usize,
) -> (Vec<usize>, Result<()>) {
    let (starts, end, fill) = match placement {
        Placement::Packed => {
            let mut starts = Vec::with_capacity(ranges.len());
            let mut at = 0;
            for r in ranges {
                starts.push(at);
                at += r.len_bytes;
            }
            buf.resize(at, 0);
            (starts, at, None)
        }
        Placement::InPhase { leads, fill } => {
            // Sized first (a buffer made at its largest is not reallocated), then laid out for
            // the address it has.
            buf.resize(in_phase_len_max(ranges, &leads), 0);
            let (starts, end) = in_phase_starts(buf.as_ptr() as usize, ranges, &leads);
            (starts, end, fill)
        }
    };
    if let Some(fill) = fill {
        fill(buf, &starts);
    }
    // The chunks lie in the buffer in order and apart.
    let (chunks, places) = cut(ranges, chunk_bytes);
    let at: Vec<usize> = places.iter().map(|&(r, o)| starts[r] + o).collect();
    let result = reader.read_into(&mut requests_at(&mut buf[..end], &chunks, &at));
    (starts, result)
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
            .spawn(move || {
                for mut job in job_rx {
                    let t0 = Instant::now();
                    let (starts, result) =
                        read_job(reader.as_ref(), &job.ranges, &mut job.buf, job.placement, chunk_bytes);
                    let done = Done {
                        key: job.key,
                        buf: job.buf,
                        starts,
                        bytes: job.ranges.iter().map(|r| r.len_bytes).sum(),
                        result,
                        read_time: t0.elapsed(),
                    };
                    if done_tx.send(done).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| Error::Invalid(format!("cannot start the prefetch thread: {e}")))?;
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
            .map_err(|_| Error::Invalid("the prefetch thread has stopped".into()))
    }

    /// The next finished job, in submission order (blocks until it is done).
    pub fn next(&self) -> Result<Done> {
        self.done
            .recv()
            .map_err(|_| Error::Invalid("the prefetch thread has stopped".into()))
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
