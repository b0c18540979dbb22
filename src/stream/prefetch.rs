//! The prefetch thread: reads whole byte ranges (a layer's streamed attention and gate) into
//! buffers while the compute thread works on the layer before, and hands them back in the order
//! they were asked for. Buffers come back to it for reuse, so steady-state decoding allocates
//! nothing and first-touch page faults stay out of the timings.

use std::sync::Arc;

use crossbeam_channel::{unbounded, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::io::{Range, Reader};

struct Job {
    key: usize,
    ranges: Vec<Range>,
    buf: Vec<u8>,
}

/// A finished job: `buf` holds the ranges back to back, in the order given.
pub struct Done {
    pub key: usize,
    pub buf: Vec<u8>,
    pub result: Result<()>,
    pub read_time: Duration,
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
                    let total: usize = job.ranges.iter().map(|r| r.len_bytes).sum();
                    job.buf.resize(total, 0);
                    // Each range cut into chunks, each chunk's place in the buffer.
                    let mut range_at = Vec::with_capacity(job.ranges.len());
                    let mut at = 0;
                    for r in &job.ranges {
                        range_at.push(at);
                        at += r.len_bytes;
                    }
                    let (chunks, places) = cut(&job.ranges, chunk_bytes);
                    let starts: Vec<usize> = places.iter().map(|&(r, o)| range_at[r] + o).collect();
                    let buf = &mut job.buf;
                    let result = reader.read_each(&chunks, &mut |i, bytes| {
                        buf[starts[i]..starts[i] + bytes.len()].copy_from_slice(bytes);
                        Ok(())
                    });
                    let done = Done {
                        key: job.key,
                        buf: job.buf,
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

    /// Queues a read of `ranges` into `buf` (reused; resized as needed).
    pub fn submit(&self, key: usize, ranges: Vec<Range>, buf: Vec<u8>) -> Result<()> {
        self.jobs
            .as_ref()
            .expect("prefetcher running")
            .send(Job { key, ranges, buf })
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
