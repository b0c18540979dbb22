//! Token-lane packing for the batched K-quant products: up to [`LANES`] prepared inputs
//! interleaved so one 64-byte load holds the same four consecutive activations of every token,
//! one 32-bit lane per token. A weight row is then read four quants at a time, broadcast to all
//! lanes, and one `vpdpbusd` multiplies them with all tokens at once: each lane holds one output,
//! so a block's scales, offsets and float arithmetic are applied once per 16 tokens instead of
//! once per token (`x86::wide` has the kernels). Built once per batch of tokens and shared by
//! every row chunk of a matrix product.

use super::layout::QK_K;
use super::prepare::ActivationFormat;
use super::PreparedInput;

/// Tokens per pack: one `i32`/`f32` lane each in a 512-bit vector.
pub(crate) const LANES: usize = 16;

/// Fewer tokens than this are multiplied one at a time: a pack costs the arithmetic of all 16
/// lanes whatever the number of tokens in it.
pub(crate) const MIN_TOKENS: usize = 3;

/// Up to [`LANES`] Q8_K-prepared inputs of `blocks` blocks, interleaved. Lanes past `tokens` are
/// zero (their results are computed and dropped).
pub(crate) struct LanePack {
    /// How many of the lanes hold a token.
    pub(crate) tokens: usize,
    /// Blocks of 256 per input.
    pub(crate) blocks: usize,
    /// `[block][group of 4 elements (64)][lane]`: the four activation quants of that group.
    pub(crate) quants: Vec<[i8; 4]>,
    /// `[block][lane]`: the block's activation scale.
    pub(crate) scales: Vec<f32>,
    /// `[block][pair of groups of 32 (4)][lane]`: the two groups' quant sums as `i16`s.
    pub(crate) sums_32: Vec<[i16; 2]>,
    /// `[block][pair of groups of 16 (8)][lane]`: the two groups' quant sums.
    pub(crate) sums_16: Vec<[i16; 2]>,
}

impl LanePack {
    /// Interleaves `xs` (1 to [`LANES`] inputs of one length, prepared as Q8_K).
    fn new(xs: &[&PreparedInput]) -> LanePack {
        assert!((1..=LANES).contains(&xs.len()), "{} tokens for one pack", xs.len());
        let len = xs[0].len();
        let blocks = len / QK_K;
        let mut pack = LanePack {
            tokens: xs.len(),
            blocks,
            quants: vec![[0; 4]; len / 4 * LANES],
            scales: vec![0.0; blocks * LANES],
            sums_32: vec![[0; 2]; blocks * 4 * LANES],
            sums_16: vec![[0; 2]; blocks * 8 * LANES],
        };
        for (t, x) in xs.iter().enumerate() {
            assert!(
                x.len() == len && ActivationFormat::for_weights(x.weight_type()) == ActivationFormat::Q8K,
                "every input of a pack is Q8_K-prepared with {len} elements"
            );
            for (g, four) in x.quants.chunks_exact(4).enumerate() {
                pack.quants[g * LANES + t] = four.try_into().expect("chunks of 4");
            }
            for (b, &scale) in x.block_scales.iter().enumerate() {
                pack.scales[b * LANES + t] = scale;
            }
            // A group of 32 sums to at most 32 * 127 in magnitude: it fits an i16.
            for (p, pair) in x.sums_32.chunks_exact(2).enumerate() {
                pack.sums_32[p * LANES + t] = [pair[0] as i16, pair[1] as i16];
            }
            for (p, pair) in x.sums_16.chunks_exact(2).enumerate() {
                pack.sums_16[p * LANES + t] = [pair[0], pair[1]];
            }
        }
        pack
    }
}

/// The tokens of one batched product, with their token-lane packs when the kernels that read
/// them run here: build one per batch (it copies the activations once, ~16 bytes per element per
/// 16 tokens) and pass it to [`super::vec_dot_tile`] for every slice of rows.
pub struct TokenTile<'a> {
    pub(crate) xs: Vec<&'a PreparedInput>,
    /// One per [`LANES`] tokens in order, or none: see [`TokenTile::new`].
    pub(crate) packs: Vec<LanePack>,
}

impl<'a> TokenTile<'a> {
    /// The tokens `xs` (prepared alike). Packed when they are Q8_K-prepared (K-quant weights),
    /// this CPU runs the token-lane kernels, and there are at least [`MIN_TOKENS`] of them; a
    /// last group of fewer than that is left unpacked.
    pub fn new(xs: &[&'a PreparedInput]) -> TokenTile<'a> {
        let lanes = xs.len() >= MIN_TOKENS
            && ActivationFormat::for_weights(xs[0].weight_type()) == ActivationFormat::Q8K
            && super::KernelFamily::detected().has_lane_kernels();
        let packs = if lanes {
            xs.chunks(LANES)
                .filter(|group| group.len() >= MIN_TOKENS)
                .map(LanePack::new)
                .collect()
        } else {
            Vec::new()
        };
        TokenTile { xs: xs.to_vec(), packs }
    }

    /// The tokens, in order.
    pub fn tokens(&self) -> &[&'a PreparedInput] {
        &self.xs
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.xs.len()
    }

    /// Whether the tile has no tokens.
    pub fn is_empty(&self) -> bool {
        self.xs.is_empty()
    }

    /// The pack of tokens `LANES * group ..`, if that group is packed.
    pub(crate) fn pack(&self, group: usize) -> Option<&LanePack> {
        self.packs.get(group)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::Rng;
    use super::super::GgmlType;
    use super::*;

    /// Every lane of a pack holds its own token's values, and the lanes past the tokens zeros.
    #[test]
    fn pack_interleaves_each_token_into_its_lane() {
        let mut rng = Rng::new(8);
        let inputs: Vec<PreparedInput> = (0..5)
            .map(|_| {
                let mut p = PreparedInput::new();
                p.prepare(&(0..512).map(|_| rng.normal()).collect::<Vec<_>>(), GgmlType::Q4_K);
                p
            })
            .collect();
        let xs: Vec<&PreparedInput> = inputs.iter().collect();
        let pack = LanePack::new(&xs);
        assert_eq!((pack.tokens, pack.blocks), (5, 2));
        for t in 0..LANES {
            for e in 0..512 {
                let want = inputs.get(t).map_or(0, |x| x.quants[e]);
                assert_eq!(pack.quants[e / 4 * LANES + t][e % 4], want, "t={t} e={e}");
            }
            for b in 0..2 {
                assert_eq!(
                    pack.scales[b * LANES + t],
                    inputs.get(t).map_or(0.0, |x| x.block_scales[b])
                );
                for g in 0..8 {
                    let want = inputs.get(t).map_or(0, |x| x.sums_32[8 * b + g]) as i16;
                    assert_eq!(pack.sums_32[(4 * b + g / 2) * LANES + t][g % 2], want);
                }
                for g in 0..16 {
                    let want = inputs.get(t).map_or(0, |x| x.sums_16[16 * b + g]);
                    assert_eq!(pack.sums_16[(8 * b + g / 2) * LANES + t][g % 2], want);
                }
            }
        }
    }
}
