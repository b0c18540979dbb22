//! The portable engine: a small pool of std threads doing `pread` (`FileExt::read_at`), with
//! O_DIRECT where available. The reference the other engines are tested against.
//!
//! Owns its worker threads and their buffer pool. It must not block the caller's thread on a single
//! read while others could proceed: ranges are handed out `queue_depth` at a time and reported in
//! completion order.

use super::buf::{AlignedBuf, BufferPool};
use super::file::{has_o_direct, open_file, read_span, DirectIo, Span};
use super::stats::{ReadStats, StatsCell};
use super::{check_range, OnDone, Range, Reader};
use crate::error::{Error, Result};
use crossbeam_channel::{unbounded, Receiver, Sender};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct PreadOptions {
    /// Worker threads (each has one read outstanding at a time).
    pub threads: usize,
    /// Ranges handed to the workers at once; bounds buffer memory.
    pub queue_depth: usize,
    pub direct_io: DirectIo,
}

impl Default for PreadOptions {
    fn default() -> Self {
        PreadOptions {
            threads: 8,
            queue_depth: 64,
            direct_io: DirectIo::Optional,
        }
    }
}

const THREADS_MAX: usize = 256;

struct Shared {
    file: File,
    path: PathBuf,
    align: usize,
    pool: BufferPool,
    stats: StatsCell,
}

struct Job {
    index: usize,
    range: Range,
    reply: Sender<Done>,
}

struct Done {
    index: usize,
    result: Result<(AlignedBuf, Span)>,
}

pub struct PreadReader {
    shared: Arc<Shared>,
    jobs: Option<Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
    len_bytes: u64,
    queue_depth: usize,
    direct_io_active: bool,
    warnings: Vec<String>,
}

impl PreadReader {
    pub fn open(path: impl AsRef<Path>, opts: &PreadOptions) -> Result<Self> {
        let path = path.as_ref();
        if opts.threads == 0 || opts.threads > THREADS_MAX || opts.queue_depth == 0 {
            return Err(Error::Input(format!(
                "pread reader: threads must be 1..={THREADS_MAX} and queue depth >= 1 (got {} and {})",
                opts.threads, opts.queue_depth
            )));
        }
        let opened = open_file(path, opts.direct_io)?;
        let shared = Arc::new(Shared {
            file: opened.file,
            path: path.to_path_buf(),
            align: opened.align_bytes,
            pool: BufferPool::new(opts.queue_depth),
            stats: StatsCell::default(),
        });
        // One queue, every worker taking from it (crossbeam's channels are multi-consumer).
        let (tx, rx) = unbounded::<Job>();
        let mut workers = Vec::with_capacity(opts.threads);
        for n in 0..opts.threads {
            let (shared, rx) = (Arc::clone(&shared), rx.clone());
            let handle = std::thread::Builder::new()
                .name(format!("gatestream-pread-{n}"))
                .spawn(move || worker(&shared, &rx))
                .map_err(|e| Error::io(path, e))?;
            workers.push(handle);
        }
        Ok(PreadReader {
            shared,
            jobs: Some(tx),
            workers,
            len_bytes: opened.len_bytes,
            queue_depth: opts.queue_depth,
            direct_io_active: opened.direct_io_active,
            warnings: opened.warnings,
        })
    }

    /// Whether the file descriptor really has O_DIRECT set (asked of the kernel).
    pub fn direct_io_active(&self) -> bool {
        self.direct_io_active && has_o_direct(&self.shared.file)
    }

    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }
}

fn worker(shared: &Shared, jobs: &Receiver<Job>) {
    use std::os::unix::fs::FileExt;
    // Ends when the reader is dropped (the channel closes).
    for job in jobs {
        let span = Span::widen(job.range, shared.align);
        let mut buf = shared.pool.get(span.dev_len_bytes);
        // A panic here would leave the batch waiting forever for this reply; report it instead.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            read_span(
                &shared.path,
                job.range,
                span,
                shared.align,
                buf.as_mut_slice(),
                &shared.stats,
                &mut |offset, b| shared.file.read_at(b, offset),
            )
        }))
        .unwrap_or_else(|_| {
            Err(Error::io(
                &shared.path,
                std::io::Error::other("a pread worker panicked"),
            ))
        });
        let result = match result {
            Ok(()) => Ok((buf, span)),
            Err(e) => {
                shared.pool.put(buf);
                Err(e)
            }
        };
        // A send fails only if the batch was abandoned (its caller unwound); nothing to do then.
        let _ = job.reply.send(Done {
            index: job.index,
            result,
        });
    }
}

impl Reader for PreadReader {
    fn read_each(&self, ranges: &[Range], on_done: &mut OnDone<'_>) -> Result<()> {
        let t0 = Instant::now();
        let result = self.read_each_inner(ranges, on_done);
        self.shared.stats.add_wall_since(t0);
        result
    }

    fn path(&self) -> &Path {
        &self.shared.path
    }

    fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    fn stats(&self) -> ReadStats {
        self.shared.stats.snapshot()
    }

    fn align_bytes(&self) -> usize {
        self.shared.align
    }

    fn reset_stats(&self) {
        self.shared.stats.reset()
    }
}

impl PreadReader {
    fn read_each_inner(&self, ranges: &[Range], on_done: &mut OnDone<'_>) -> Result<()> {
        let path = &self.shared.path;
        for &r in ranges {
            check_range(path, r, self.len_bytes)?;
        }
        self.shared
            .stats
            .add_requests(ranges.len() as u64, ranges.iter().map(|r| r.len_bytes as u64).sum());
        for (i, r) in ranges.iter().enumerate() {
            if r.len_bytes == 0 {
                on_done(i, &[])?;
            }
        }
        let jobs = self.jobs.as_ref().expect("present until drop");
        let (reply, done) = unbounded::<Done>();
        let (mut next, mut in_flight) = (0usize, 0usize);
        let mut first_err: Option<Error> = None;
        loop {
            while first_err.is_none() && next < ranges.len() && in_flight < self.queue_depth {
                let (index, range) = (next, ranges[next]);
                next += 1;
                if range.len_bytes == 0 {
                    continue;
                }
                let job = Job {
                    index,
                    range,
                    reply: reply.clone(),
                };
                if jobs.send(job).is_err() {
                    first_err = Some(Error::io(
                        path,
                        std::io::Error::other("all pread worker threads have exited"),
                    ));
                    break;
                }
                in_flight += 1;
            }
            if in_flight == 0 {
                break;
            }
            let Ok(d) = done.recv() else {
                return Err(Error::io(
                    path,
                    std::io::Error::other("a pread worker thread died mid-read"),
                ));
            };
            in_flight -= 1;
            match d.result {
                Ok((buf, span)) => {
                    if first_err.is_none() {
                        let len = ranges[d.index].len_bytes;
                        let bytes = &buf.as_slice()[span.head_bytes..span.head_bytes + len];
                        if let Err(e) = on_done(d.index, bytes) {
                            first_err = Some(e);
                        }
                    }
                    self.shared.pool.put(buf);
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for PreadReader {
    fn drop(&mut self) {
        self.jobs = None; // workers see a closed channel and exit
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
