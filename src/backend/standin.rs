//! A host stand-in for a device with memory of its own, so the paths that feed such a device
//! (the streaming path above all) can be tested where there is no GPU. It computes with the CPU
//! device, but only on its own copies of the weights it is handed, kept the way the CUDA device
//! keeps them: a resident weight is copied at first sight and found again by its address; a
//! volatile one (a buffer the stream refills, [`Weight::is_volatile`]) is copied at each use. A
//! streamed buffer handed over without that mark is then computed from a stale copy, and a test
//! comparing with the in-RAM model fails. It reports `host_memory() == false`, as the CUDA
//! device does. Not a compute device to run models on.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::cpu::CpuBackend;
use super::{Act, AttnShape, Device, LinkCounters, RopeShape};
use crate::config::FfnActivation;
use crate::kv::KvCache;
use crate::tensor::Weight;

/// Resident copies: by (address, length, row stride) of the original bytes, the copy and what
/// keeps the original alive.
type Copies = HashMap<(usize, usize, usize), (Weight, Arc<dyn std::any::Any + Send + Sync>)>;

pub struct HostStandIn {
    cpu: CpuBackend,
    /// Resident copies by (address, length, row stride) of the bytes they were made of, each
    /// holding those bytes alive (as the CUDA device does) so no other buffer takes the address.
    resident: Mutex<Copies>,
    /// Bytes copied for resident weights (once each) and for volatile ones (at every use).
    resident_bytes: AtomicU64,
    volatile_bytes: AtomicU64,
    /// Volatile copies made, by weight name.
    volatile_uses: Mutex<HashMap<String, u64>>,
}

impl HostStandIn {
    pub fn new(threads: usize) -> HostStandIn {
        HostStandIn {
            cpu: CpuBackend::new(threads),
            resident: Mutex::new(HashMap::new()),
            resident_bytes: AtomicU64::new(0),
            volatile_bytes: AtomicU64::new(0),
            volatile_uses: Mutex::new(HashMap::new()),
        }
    }

    /// How many volatile copies were made of weights whose name contains `part` (a streamed
    /// layer's `ffn_up` rows, say: one copy per pass that computed them here).
    pub fn volatile_uses(&self, part: &str) -> u64 {
        let uses = self.volatile_uses.lock().expect("volatile uses");
        uses.iter()
            .filter(|(name, _)| name.contains(part))
            .map(|(_, n)| n)
            .sum()
    }

    /// Bytes copied "to the device" so far: (resident weights, volatile weights).
    pub fn copied_bytes(&self) -> (u64, u64) {
        (
            self.resident_bytes.load(Ordering::Relaxed),
            self.volatile_bytes.load(Ordering::Relaxed),
        )
    }

    /// The stand-in's own copy of `w`'s bytes, as a weight over them.
    fn on_device(&self, w: &Weight) -> Weight {
        let Some((bytes, keep)) = w.span() else {
            panic!(
                "{}: a weight whose bytes are on disk reached the device (streamed weights arrive as the stream's buffers)",
                w.name
            );
        };
        let copy = || {
            Weight::shared_strided(
                &w.name,
                w.ty,
                w.rows,
                w.cols,
                Arc::new(bytes.to_vec()),
                0,
                w.row_stride_bytes,
            )
            .expect("the copy has the original's shape")
        };
        if w.is_volatile() {
            self.volatile_bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
            *self
                .volatile_uses
                .lock()
                .expect("volatile uses")
                .entry(w.name.clone())
                .or_default() += 1;
            return copy();
        }
        let key = (bytes.as_ptr() as usize, bytes.len(), w.row_stride_bytes);
        let mut resident = self.resident.lock().expect("resident copies");
        resident
            .entry(key)
            .or_insert_with(|| {
                self.resident_bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                (copy(), keep)
            })
            .0
            .clone()
    }
}

impl Device for HostStandIn {
    fn name(&self) -> String {
        format!("host stand-in for a device ({})", Device::name(&self.cpu))
    }
    fn run<'a>(&self, f: Box<dyn FnOnce() + Send + 'a>) {
        self.cpu.run(f)
    }
    fn host_memory(&self) -> bool {
        false
    }
    fn link(&self) -> Option<LinkCounters> {
        let (resident_bytes, volatile_bytes) = self.copied_bytes();
        Some(LinkCounters {
            resident_bytes,
            volatile_bytes,
            volatile_copies: self.volatile_uses(""),
            copy_ns: 0,
        })
    }
    fn upload(&self, rows: usize, width: usize, values: Vec<f32>) -> Act {
        self.cpu.upload(rows, width, values)
    }
    fn zeros(&self, rows: usize, width: usize) -> Act {
        self.cpu.zeros(rows, width)
    }
    fn copy(&self, x: &Act) -> Act {
        self.cpu.copy(x)
    }
    fn to_host<'a>(&self, a: &'a Act) -> Cow<'a, [f32]> {
        self.cpu.to_host(a)
    }
    fn download(&self, a: Act) -> Vec<f32> {
        self.cpu.download(a)
    }
    fn embed(&self, w: &Weight, ids: &[u32], scale: f32) -> Act {
        self.cpu.embed(&self.on_device(w), ids, scale)
    }
    fn rms_norm(&self, x: &Act, w: &[f32], eps: f32) -> Act {
        self.cpu.rms_norm(x, w, eps)
    }
    fn rms_norm_in_place(&self, x: &mut Act, w: &[f32], eps: f32) {
        self.cpu.rms_norm_in_place(x, w, eps)
    }
    fn add(&self, x: &mut Act, y: &Act) {
        self.cpu.add(x, y)
    }
    fn add_bias(&self, x: &mut Act, b: &[f32]) {
        self.cpu.add_bias(x, b)
    }
    fn mul(&self, x: &mut Act, y: &Act) {
        self.cpu.mul(x, y)
    }
    fn activate(&self, x: &mut Act, f: FfnActivation) {
        self.cpu.activate(x, f)
    }
    fn softcap(&self, x: &mut Act, cap: f32) {
        self.cpu.softcap(x, cap)
    }
    fn select_rows(&self, x: &Act, rows: &[usize]) -> Act {
        self.cpu.select_rows(x, rows)
    }
    fn scatter_cols(&self, x: &Act, cols: &[u32], width: usize) -> Act {
        self.cpu.scatter_cols(x, cols, width)
    }
    fn gather_cols(&self, x: &Act, cols: &[u32]) -> Act {
        self.cpu.gather_cols(x, cols)
    }
    fn add_rows_scaled(&self, out: &mut Act, y: &Act, rows: &[usize], scales: &[f32]) {
        self.cpu.add_rows_scaled(out, y, rows, scales)
    }
    fn matmul(&self, ws: &[&Weight], x: &Act) -> Vec<Act> {
        let copies: Vec<Weight> = ws.iter().map(|w| self.on_device(w)).collect();
        self.cpu.matmul(&copies.iter().collect::<Vec<_>>(), x)
    }
    fn matmul_rows(&self, w: &Weight, rows: &[u32], x: &Act) -> Act {
        self.cpu.matmul_rows(&self.on_device(w), rows, x)
    }
    fn accumulate_rows(&self, w: &Weight, rows: Option<&[u32]>, acts: &Act, out: &mut Act) {
        self.cpu.accumulate_rows(&self.on_device(w), rows, acts, out)
    }
    fn rope_qk(
        &self,
        q: &mut Act,
        k: &mut Act,
        positions: &[usize],
        shape: RopeShape,
        q_norm: Option<&[f32]>,
        k_norm: Option<&[f32]>,
        eps: f32,
    ) {
        self.cpu.rope_qk(q, k, positions, shape, q_norm, k_norm, eps)
    }
    fn kv_write(
        &self,
        layer: usize,
        k: &Act,
        v: &Act,
        positions: &[usize],
        seq_of_token: &[usize],
        caches: &mut [&mut KvCache],
    ) {
        self.cpu.kv_write(layer, k, v, positions, seq_of_token, caches)
    }
    fn attention(
        &self,
        q: &Act,
        positions: &[usize],
        seq_of_token: &[usize],
        caches: &[&mut KvCache],
        shape: AttnShape,
    ) -> Act {
        self.cpu.attention(q, positions, seq_of_token, caches, shape)
    }
}
