//! The neuron cache of one layer: a fixed number of slots, each holding one neuron's up row and
//! down column. It starts with the file's first neurons (the hot prefix when the file was
//! reformatted hot-first). `Pinned` never replaces them (the right choice for dense streaming,
//! which scans every neuron and would evict everything an LRU kept); `Lru` replaces the least
//! recently used slot with each neuron read from disk (windowing across tokens).
//!
//! Knows neurons and bytes; never files or reads.
//!
//! Why not the `lru` crate: slots are fixed rows in one contiguous buffer the compute reads in
//! place, a pinned policy shares them, and replacement must return the slot index; a generic
//! key-value LRU would add a map and a copy per hit.
//!
//! The buffers are shared (`Arc`): a set of neurons held in consecutive slots, in order (a dense
//! step over a cache that holds the whole layer, or its hot prefix), is handed to the compute as
//! a view of them ([`LayerCache::run_of`]), not copied. A slot written while such a view is alive
//! (never, as the stream uses it: views live for one layer's products, slots change in a later
//! fetch) first moves the buffer to a copy, the old one kept alive until the cache drops (the
//! device may have locked its pages).
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CachePolicy {
    Pinned,
    Lru,
    /// Expert caches only: the expert routed to least often goes first (LRU among equals).
    Frequency,
}

impl CachePolicy {
    pub fn name(self) -> &'static str {
        match self {
            CachePolicy::Pinned => "pinned",
            CachePolicy::Lru => "lru",
            CachePolicy::Frequency => "frequency",
        }
    }
}

const NONE: u32 = u32::MAX;

pub struct LayerCache {
    policy: CachePolicy,
    up_row: usize,
    down_row: usize,
    /// Per neuron: its slot, or `NONE`.
    slot_of: Vec<u32>,
    /// Per slot: its neuron, or `NONE`.
    owner: Vec<u32>,
    /// Per slot: the step it was last used in.
    last_used: Vec<u64>,
    up: Arc<Vec<u8>>,
    down: Arc<Vec<u8>>,
    /// Buffers a view still held when a slot was written (see the module docs).
    retired: Vec<Arc<Vec<u8>>>,
    /// Slots ordered for eviction in the current step (oldest first), built lazily.
    victims: Vec<u32>,
    victims_step: Option<u64>,
}

impl LayerCache {
    pub fn new(policy: CachePolicy, ffn: usize, slots: usize, up_row: usize, down_row: usize) -> LayerCache {
        let slots = slots.min(ffn);
        LayerCache {
            policy,
            up_row,
            down_row,
            slot_of: vec![NONE; ffn],
            owner: vec![NONE; slots],
            last_used: vec![0; slots],
            up: Arc::new(vec![0; slots * up_row]),
            down: Arc::new(vec![0; slots * down_row]),
            retired: Vec::new(),
            victims: Vec::new(),
            victims_step: None,
        }
    }

    pub fn slots(&self) -> usize {
        self.owner.len()
    }

    /// Puts neuron `neuron` into slot `slot` (setup: the first neurons fill the slots in order).
    pub fn fill(&mut self, slot: usize, neuron: u32, up: &[u8], down: &[u8]) {
        let old = self.owner[slot];
        if old != NONE {
            self.slot_of[old as usize] = NONE;
        }
        self.owner[slot] = neuron;
        self.slot_of[neuron as usize] = slot as u32;
        let (ur, dr) = (self.up_row, self.down_row);
        writable(&mut self.up, &mut self.retired)[slot * ur..(slot + 1) * ur].copy_from_slice(up);
        writable(&mut self.down, &mut self.retired)[slot * dr..(slot + 1) * dr].copy_from_slice(down);
    }

    /// The buffers of up rows and down columns, slot `s` at `s * row bytes`.
    pub fn buffers(&self) -> (&Arc<Vec<u8>>, &Arc<Vec<u8>>) {
        (&self.up, &self.down)
    }

    /// The first slot of `set` when its neurons sit in consecutive slots in its order (slot
    /// `first + i` holds `set[i]`), so the rows can be used in place; `None` otherwise or for an
    /// empty set. Records no use (see [`LayerCache::touch`]).
    pub fn run_of(&self, set: &[u32]) -> Option<usize> {
        let first = self
            .slot_of
            .get(*set.first()? as usize)
            .copied()
            .filter(|&s| s != NONE)? as usize;
        set.iter()
            .enumerate()
            .all(|(i, &n)| self.slot_of.get(n as usize) == Some(&((first + i) as u32)))
            .then_some(first)
    }

    /// Whether the cache holds the whole layer and every neuron of `set` in its own slot (slot
    /// n = neuron n, as a cache filled in neuron order and never changed): its buffers are then
    /// the layer's matrices, and `set` indexes them.
    pub fn holds_in_place(&self, set: &[u32]) -> bool {
        self.slots() == self.slot_of.len() && set.iter().all(|&n| self.slot_of.get(n as usize) == Some(&n))
    }

    /// The neuron's cached (up row, down column), marking it used in `step`.
    pub fn get(&mut self, neuron: u32, step: u64) -> Option<(&[u8], &[u8])> {
        let slot = self.slot_of[neuron as usize];
        if slot == NONE {
            return None;
        }
        let s = slot as usize;
        self.last_used[s] = step;
        Some((
            &self.up[s * self.up_row..(s + 1) * self.up_row],
            &self.down[s * self.down_row..(s + 1) * self.down_row],
        ))
    }

    /// The slot holding `neuron`, if any (no use is recorded: see [`LayerCache::touch`]).
    pub fn slot(&self, neuron: u32) -> Option<usize> {
        let s = self.slot_of[neuron as usize];
        (s != NONE).then_some(s as usize)
    }

    /// Records a use of `slot` in `step` (for LRU order).
    pub fn touch(&mut self, slot: usize, step: u64) {
        self.last_used[slot] = step;
    }

    /// The (up row, down column) in `slot`.
    pub fn rows(&self, slot: usize) -> (&[u8], &[u8]) {
        (
            &self.up[slot * self.up_row..(slot + 1) * self.up_row],
            &self.down[slot * self.down_row..(slot + 1) * self.down_row],
        )
    }

    pub fn contains(&self, neuron: u32) -> bool {
        self.slot_of[neuron as usize] != NONE
    }

    /// Offers a neuron just read from disk. `Lru` stores it in the least recently used slot not
    /// used in this step (if any); `Pinned` ignores it.
    pub fn offer(&mut self, neuron: u32, up: &[u8], down: &[u8], step: u64) {
        if self.policy == CachePolicy::Pinned || self.slots() == 0 || self.contains(neuron) {
            return;
        }
        if self.victims_step != Some(step) {
            self.victims.clear();
            self.victims
                .extend((0..self.slots() as u32).filter(|&s| self.last_used[s as usize] < step));
            let last = &self.last_used;
            // Oldest last: victims are popped from the end.
            self.victims
                .sort_unstable_by(|&a, &b| last[b as usize].cmp(&last[a as usize]));
            self.victims_step = Some(step);
        }
        let Some(slot) = self.victims.pop() else {
            return;
        };
        self.fill(slot as usize, neuron, up, down);
        self.last_used[slot as usize] = step;
    }
}

/// `buf` for writing: in place, or (a view still holds it) as a copy, the old buffer retired.
fn writable<'a>(buf: &'a mut Arc<Vec<u8>>, retired: &mut Vec<Arc<Vec<u8>>>) -> &'a mut Vec<u8> {
    if Arc::get_mut(buf).is_none() {
        let copy = Arc::new(buf.as_ref().clone());
        retired.push(std::mem::replace(buf, copy));
    }
    Arc::get_mut(buf).expect("just made unique")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: u32) -> (Vec<u8>, Vec<u8>) {
        (vec![n as u8; 3], vec![n as u8 + 100; 5])
    }

    #[test]
    fn lru_keeps_what_was_used_lately_and_never_evicts_within_a_step() {
        let mut c = LayerCache::new(CachePolicy::Lru, 10, 3, 3, 5);
        for n in 0..3u32 {
            let (u, d) = bytes(n);
            c.fill(n as usize, n, &u, &d);
        }
        // Step 1 uses neurons 0 and 1; neuron 7 arrives and replaces the unused 2.
        assert!(c.get(0, 1).is_some() && c.get(1, 1).is_some());
        let (u, d) = bytes(7);
        c.offer(7, &u, &d, 1);
        assert!(c.contains(7) && !c.contains(2));
        // Nothing else is free in step 1: neuron 8 is not stored.
        let (u, d) = bytes(8);
        c.offer(8, &u, &d, 1);
        assert!(!c.contains(8));
        let (up, down) = c.get(7, 2).unwrap();
        assert_eq!((up, down), (&[7u8; 3][..], &[107u8; 5][..]));
        // Step 2 used 7; the oldest of 0 and 1 (both step 1) goes first.
        c.offer(8, &u, &d, 2);
        assert!(c.contains(8) && c.contains(7));
    }

    #[test]
    fn pinned_never_changes() {
        let mut c = LayerCache::new(CachePolicy::Pinned, 10, 2, 3, 5);
        for n in 0..2u32 {
            let (u, d) = bytes(n);
            c.fill(n as usize, n, &u, &d);
        }
        let (u, d) = bytes(5);
        c.offer(5, &u, &d, 9);
        assert!(!c.contains(5) && c.contains(0) && c.contains(1));
    }

    #[test]
    fn a_run_of_consecutive_slots_is_found_and_a_write_under_a_view_leaves_the_view_alone() {
        let mut c = LayerCache::new(CachePolicy::Lru, 10, 4, 3, 5);
        for n in 0..4u32 {
            let (u, d) = bytes(n);
            c.fill(n as usize, n, &u, &d);
        }
        assert_eq!(c.run_of(&[0, 1, 2, 3]), Some(0));
        assert_eq!(c.run_of(&[1, 2]), Some(1));
        assert_eq!(c.run_of(&[0, 2]), None, "a gap");
        assert_eq!(c.run_of(&[1, 0]), None, "out of order");
        assert_eq!(c.run_of(&[3, 4]), None, "4 is not cached");
        assert_eq!(c.run_of(&[]), None);
        assert_eq!(c.run_of(&[12]), None, "past the layer");
        let view = c.buffers().0.clone();
        // Neuron 7 replaces slot 2 while the view lives: the view keeps its bytes.
        c.get(0, 1);
        c.get(1, 1);
        c.get(3, 1);
        let (u, d) = bytes(7);
        c.offer(7, &u, &d, 1);
        assert_eq!(c.slot(7), Some(2));
        assert_eq!(&view[6..9], &[2, 2, 2]);
        assert_eq!(&c.buffers().0[6..9], &[7, 7, 7]);
        assert_eq!(c.run_of(&[0, 1, 2]), None);
        assert_eq!(c.run_of(&[0, 1, 7, 3]), Some(0));
        // Only a cache of the whole layer serves ids in place, and only neurons in their own slot.
        assert!(!c.holds_in_place(&[0, 1]), "4 slots of 10 neurons");
        let mut whole = LayerCache::new(CachePolicy::Lru, 4, 4, 3, 5);
        for n in 0..4u32 {
            let (u, d) = bytes(n);
            whole.fill(n as usize, n, &u, &d);
        }
        assert!(whole.holds_in_place(&[0, 2, 3]) && whole.holds_in_place(&[]));
        assert!(!whole.holds_in_place(&[1, 4]), "past the layer");
        let (u, d) = bytes(2);
        whole.fill(1, 2, &u, &d);
        assert!(!whole.holds_in_place(&[2]) && whole.holds_in_place(&[0, 3]));
    }
}
