//! Token-lane packing for the batched products (Q4_K, Q6_K, Q2_K, Q3_K, IQ4_XS, Q4_0, Q5_0, Q8_0,
//! IQ4_NL, MXFP4 weights): up to [`LANES`] prepared inputs interleaved so one 64-byte load holds the same four consecutive activations of every token,
//! one 32-bit lane per token. A weight row is then read four quants at a time, broadcast to all
//! lanes, and one `vpdpbusd` multiplies them with all tokens at once: each lane holds one output,
//! so a block's scales, offsets and float arithmetic are applied once per 16 tokens instead of
//! once per token (`x86::wide`, `x86::lowwide` and `x86::exact32` have the kernels). Built once per batch of tokens and shared by
//! every row chunk of a matrix product.

use super::prepare::ActivationFormat;
use super::{GgmlType, PreparedInput};

/// Tokens per pack: one `i32`/`f32` lane each in a 512-bit vector.
pub(crate) const LANES: usize = 16;

/// Fewer tokens than this are multiplied one at a time: a pack costs the arithmetic of all 16
/// lanes whatever the number of tokens in it.
pub(crate) const MIN_TOKENS: usize = 3;

/// Whether the VNNI family has token-lane kernels for rows of `ty`.
pub(crate) fn has_lane_kernel(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_K
            | GgmlType::Q6_K
            | GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::IQ4_XS
            | GgmlType::Q4_0
            | GgmlType::Q5_0
            | GgmlType::Q8_0
            | GgmlType::Q5_1
            | GgmlType::IQ4_NL
            | GgmlType::MXFP4
    )
}

/// Up to [`LANES`] inputs prepared alike (Q8_K blocks of 256, or Q8_0-style blocks of 32),
/// interleaved. Lanes past `tokens` are zero (their results are computed and dropped).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct LanePack {
    /// How many of the lanes hold a token.
    pub(crate) tokens: usize,
    /// Activation blocks (of 256 or 32) per input.
    pub(crate) blocks: usize,
    /// `[group of 4 elements][lane]`: the four activation quants of that group.
    pub(crate) quants: Vec<[i8; 4]>,
    /// `[block][lane]`: the block's activation scale.
    pub(crate) scales: Vec<f32>,
    /// Q8_K: `[block][pair of groups of 32 (4)][lane]`, the two groups' quant sums as `i16`s.
    pub(crate) sums_32: Vec<[i16; 2]>,
    /// Q8_K: `[block][pair of groups of 16 (8)][lane]`, the two groups' quant sums.
    pub(crate) sums_16: Vec<[i16; 2]>,
    /// Blocks of 32: `[block][lane]`, the block's quant sum.
    pub(crate) block_sums: Vec<i32>,
}

impl LanePack {
    /// Interleaves `xs` (1 to [`LANES`] inputs of one length and activation format).
    fn new(xs: &[&PreparedInput]) -> LanePack {
        assert!((1..=LANES).contains(&xs.len()), "{} tokens for one pack", xs.len());
        let len = xs[0].len();
        let format = ActivationFormat::for_weights(xs[0].weight_type());
        let k_blocks = format == ActivationFormat::Q8K;
        let blocks = xs[0].block_scales.len();
        let mut pack = LanePack {
            tokens: xs.len(),
            blocks,
            quants: vec![[0; 4]; len / 4 * LANES],
            scales: vec![0.0; blocks * LANES],
            sums_32: vec![[0; 2]; if k_blocks { blocks * 4 * LANES } else { 0 }],
            sums_16: vec![[0; 2]; if k_blocks { blocks * 8 * LANES } else { 0 }],
            block_sums: vec![0; if k_blocks { 0 } else { blocks * LANES }],
        };
        for (t, x) in xs.iter().enumerate() {
            assert!(
                x.len() == len
                    && ActivationFormat::for_weights(x.weight_type()) == format
                    && format != ActivationFormat::F32,
                "every input of a pack is quantized alike with {len} elements"
            );
            if !k_blocks {
                for (b, &sum) in x.sums_32.iter().enumerate() {
                    pack.block_sums[b * LANES + t] = sum;
                }
            }
            for (g, four) in x.quants.chunks_exact(4).enumerate() {
                pack.quants[g * LANES + t] = four.try_into().expect("chunks of 4");
            }
            for (b, &scale) in x.block_scales.iter().enumerate() {
                pack.scales[b * LANES + t] = scale;
            }
            if k_blocks {
                // A group of 32 sums to at most 32 * 127 in magnitude: it fits an i16.
                for (p, pair) in x.sums_32.chunks_exact(2).enumerate() {
                    pack.sums_32[p * LANES + t] = [pair[0] as i16, pair[1] as i16];
                }
                for (p, pair) in x.sums_16.chunks_exact(2).enumerate() {
                    pack.sums_16[p * LANES + t] = [pair[0], pair[1]];
                }
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
    /// The tokens `xs` (prepared alike). Packed when they were prepared for a weight type with
    /// token-lane kernels ([`has_lane_kernel`]) that this CPU runs, and there are at least
    /// [`MIN_TOKENS`] of them; a last group of fewer than that is left unpacked.
    pub fn new(xs: &[&'a PreparedInput]) -> TokenTile<'a> {
        let lanes = xs.len() >= MIN_TOKENS
            && has_lane_kernel(xs[0].weight_type())
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

    /// The pack of tokens `LANES * group ..`, if that group is packed (read by the x86 kernels).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn pack(&self, group: usize) -> Option<&LanePack> {
        self.packs.get(group)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::Rng;
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
        // Blocks of 32 (Q8_0-style activations): one scale and one sum per block.
        let legacy: Vec<PreparedInput> = (0..3)
            .map(|_| {
                let mut p = PreparedInput::new();
                p.prepare(&(0..64).map(|_| rng.normal()).collect::<Vec<_>>(), GgmlType::Q5_0);
                p
            })
            .collect();
        let pack = LanePack::new(&legacy.iter().collect::<Vec<_>>());
        assert_eq!((pack.tokens, pack.blocks, pack.sums_32.len()), (3, 2, 0));
        for (t, x) in legacy.iter().enumerate() {
            for b in 0..2 {
                assert_eq!(pack.scales[b * LANES + t], x.block_scales[b]);
                assert_eq!(pack.block_sums[b * LANES + t], x.sums_32[b]);
            }
            assert_eq!(pack.quants[9 * LANES + t], x.quants[36..40]);
        }
    }

    /// Packs are built only for the weight types with token-lane kernels, and not for a last
    /// group of fewer than MIN_TOKENS tokens.
    #[test]
    fn tiles_pack_lane_types_in_groups() {
        let prepared = |ty| {
            let mut p = PreparedInput::new();
            p.prepare(&[0.5; 256], ty);
            p
        };
        let (q4k, q41) = (prepared(GgmlType::Q4_K), prepared(GgmlType::Q4_1));
        let lanes = super::super::KernelFamily::detected().has_lane_kernels();
        assert_eq!(TokenTile::new(&[&q4k; 18]).packs.len(), if lanes { 1 } else { 0 });
        assert_eq!(TokenTile::new(&[&q4k; 19]).packs.len(), if lanes { 2 } else { 0 });
        assert_eq!(TokenTile::new(&[&q4k; 2]).packs.len(), 0);
        assert_eq!(TokenTile::new(&[&q41; 16]).packs.len(), 0);
    }
}
