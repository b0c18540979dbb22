//! The CUDA device's modes in one place. Each is set by `--cuda-opt KEY=VALUE` (repeatable, on
//! every command that opens a device), or for scripts and CI by one variable,
//! `GATESTREAM_CUDA_OPTS=KEY=VALUE,KEY=VALUE`; a mode's own variable (`GATESTREAM_CUDA_<KEY>`)
//! still works, and `--cuda-opt` wins over `GATESTREAM_CUDA_OPTS`, which wins over it.
//! `--cuda-opt help` prints the table below: each mode's values and default. The device parses
//! and checks the values (`cuda::CudaOptions::from_vars`), so a bad value is refused with what
//! the mode's values mean; this module only routes them. Built with or without the `cuda`
//! feature (the help is the same).

use crate::error::{Error, Result};

/// One mode: its key, the variable it sets, its values, its default and what it does.
pub struct CudaMode {
    pub key: &'static str,
    pub var: &'static str,
    pub values: &'static str,
    pub default: &'static str,
    pub what: &'static str,
}

/// The variable holding several modes at once.
pub const CUDA_OPTS_ENV: &str = "GATESTREAM_CUDA_OPTS";

/// Every mode, in the order `--cuda-opt help` prints them.
pub const CUDA_MODES: &[CudaMode] = &[
    CudaMode {
        key: "activations",
        var: "GATESTREAM_CUDA_ACTIVATIONS",
        values: "auto, f32, q8, int8",
        default: "auto",
        what: "what quantized products multiply: auto = int8 for Q4_K/Q6_K, f32 for the rest",
    },
    CudaMode {
        key: "map-host",
        var: "GATESTREAM_CUDA_MAP_HOST",
        values: "1, 0",
        default: "1",
        what: "--vram-budget's neuron cache mapped: masked decode reads kept rows in place",
    },
    CudaMode {
        key: "graphs",
        var: "GATESTREAM_CUDA_GRAPHS",
        values: "1, 0",
        default: "1",
        what: "repeated launch sequences replayed as CUDA graphs",
    },
    CudaMode {
        key: "graph-split",
        var: "GATESTREAM_CUDA_GRAPH_SPLIT",
        values: "0 or N >= 8",
        default: "48",
        what: "a recording launched every N operations (0: whole steps)",
    },
    CudaMode {
        key: "mma",
        var: "GATESTREAM_CUDA_MMA",
        values: "1, 0",
        default: "1",
        what: "batches of quantized products on the tensor cores",
    },
    CudaMode {
        key: "mmq",
        var: "GATESTREAM_CUDA_MMQ",
        values: "1, 0",
        default: "1",
        what: "wide Q4_K/Q6_K batches as integer tiles (0: f16 pairs)",
    },
    CudaMode {
        key: "int8-tokens",
        var: "GATESTREAM_CUDA_INT8_TOKENS",
        values: "1 to 8",
        default: "8",
        what: "the most tokens whose Q4_K/Q6_K products run as integers",
    },
    CudaMode {
        key: "attn-tiles",
        var: "GATESTREAM_CUDA_ATTN_TILES",
        values: "1, 0",
        default: "1",
        what: "a prompt's attention in tiles of 16 tokens",
    },
    CudaMode {
        key: "attn-split",
        var: "GATESTREAM_CUDA_ATTN_SPLIT",
        values: "1, 0",
        default: "1",
        what: "a decode token's attention split over positions",
    },
    CudaMode {
        key: "fuse",
        var: "GATESTREAM_CUDA_FUSE",
        values: "1, 0",
        default: "0",
        what: "small launches done by the last blocks of the one before (slower on an H200)",
    },
    CudaMode {
        key: "matvec-rows",
        var: "GATESTREAM_CUDA_MATVEC_ROWS",
        values: "1, 2, 4",
        default: "1",
        what: "rows per warp of one-token f32-activation products",
    },
    CudaMode {
        key: "i8-wpr",
        var: "GATESTREAM_CUDA_I8_WPR",
        values: "auto, 1, 2, 4, 8",
        default: "auto",
        what: "warps per row of one-token integer products",
    },
    CudaMode {
        key: "mmq-prefetch",
        var: "GATESTREAM_CUDA_MMQ_PREFETCH",
        values: "1, 0",
        default: "0",
        what: "integer tiles load the next super-block ahead (not yet timed)",
    },
];

/// The table `--cuda-opt help` prints.
pub fn help() -> String {
    let w =
        |f: fn(&CudaMode) -> &str, head: &str| CUDA_MODES.iter().map(|m| f(m).len()).max().unwrap_or(0).max(head.len());
    let (kw, vw, dw) = (
        w(|m| m.key, "mode"),
        w(|m| m.values, "values"),
        w(|m| m.default, "default"),
    );
    let mut s = format!(
        "CUDA device modes: --cuda-opt KEY=VALUE (repeatable), or {CUDA_OPTS_ENV}=KEY=VALUE,KEY=VALUE\n\n\
         {:kw$}  {:vw$}  {:dw$}  what\n",
        "mode", "values", "default"
    );
    for m in CUDA_MODES {
        s += &format!("{:kw$}  {:vw$}  {:dw$}  {}\n", m.key, m.values, m.default, m.what);
    }
    s
}

/// `KEY=VALUE` items (from `--cuda-opt`, or `GATESTREAM_CUDA_OPTS` split at commas) as
/// (variable, value) pairs; an unknown key, or an item without `=`, is refused naming `from`
/// and listing the keys.
pub fn parse(items: &[String], from: &str) -> Result<Vec<(&'static str, String)>> {
    items
        .iter()
        .map(|item| {
            let keys = || CUDA_MODES.iter().map(|m| m.key).collect::<Vec<_>>().join(", ");
            let (k, v) = item.split_once('=').ok_or_else(|| {
                Error::Input(format!(
                    "{from} {item:?}: expected KEY=VALUE (keys: {}; `--cuda-opt help` lists their values)",
                    keys()
                ))
            })?;
            let mode = CUDA_MODES.iter().find(|m| m.key == k.trim()).ok_or_else(|| {
                Error::Input(format!(
                    "{from} {item:?}: no CUDA mode {:?} (keys: {}; `--cuda-opt help` lists their values)",
                    k.trim(),
                    keys()
                ))
            })?;
            Ok((mode.var, v.trim().to_string()))
        })
        .collect()
}

/// The variables the CUDA device reads, with `cli` (`--cuda-opt` items) and
/// `GATESTREAM_CUDA_OPTS` (read through `env`) over the modes' own variables.
pub fn with_opts<'a>(
    cli: &[String],
    env: &'a dyn Fn(&str) -> Option<String>,
) -> Result<impl Fn(&str) -> Option<String> + 'a> {
    let from_env: Vec<String> = env(CUDA_OPTS_ENV)
        .map(|s| {
            s.split(',')
                .map(str::trim)
                .filter(|i| !i.is_empty())
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
    let mut set = parse(&from_env, CUDA_OPTS_ENV)?;
    // (Later entries win: --cuda-opt after the variable's.)
    set.extend(parse(cli, "--cuda-opt")?);
    Ok(move |name: &str| {
        set.iter()
            .rev()
            .find(|(var, _)| *var == name)
            .map(|(_, v)| v.clone())
            .or_else(|| env(name))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_options_win_over_the_variable_which_wins_over_a_mode_s_own() {
        let env = |name: &str| match name {
            CUDA_OPTS_ENV => Some("fuse=1, graphs=0".to_string()),
            "GATESTREAM_CUDA_GRAPHS" => Some("1".to_string()),
            "GATESTREAM_CUDA_MMA" => Some("0".to_string()),
            _ => None,
        };
        let cli = vec!["graphs=1".to_string(), "int8-tokens=4".to_string()];
        let var = with_opts(&cli, &env).unwrap();
        assert_eq!(var("GATESTREAM_CUDA_FUSE").as_deref(), Some("1"));
        assert_eq!(var("GATESTREAM_CUDA_GRAPHS").as_deref(), Some("1"));
        assert_eq!(var("GATESTREAM_CUDA_INT8_TOKENS").as_deref(), Some("4"));
        assert_eq!(var("GATESTREAM_CUDA_MMA").as_deref(), Some("0"));
        assert_eq!(var("GATESTREAM_CUDA_ATTN_SPLIT"), None);
        let e = with_opts(&["fusion=1".to_string()], &env).err().unwrap().to_string();
        assert!(
            e.contains("--cuda-opt") && e.contains("\"fusion\"") && e.contains("fuse"),
            "{e}"
        );
        let e = with_opts(&["fuse".to_string()], &env).err().unwrap().to_string();
        assert!(e.contains("KEY=VALUE"), "{e}");
        let bad = |n: &str| (n == CUDA_OPTS_ENV).then(|| "mma=1,x=2".to_string());
        let e = with_opts(&[], &bad).err().unwrap().to_string();
        assert!(e.contains(CUDA_OPTS_ENV) && e.contains("\"x\""), "{e}");
    }

    #[test]
    fn the_help_lists_every_mode_with_its_default() {
        let h = help();
        for m in CUDA_MODES {
            assert!(
                h.lines().any(|l| l.starts_with(m.key) && l.contains(m.default)),
                "{}",
                m.key
            );
        }
    }

    /// The table names the variables the device reads, and its defaults are the device's.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_table_matches_the_device_s_variables_and_defaults() {
        use crate::backend::cuda::*;
        let vars = [
            ACTIVATIONS_ENV,
            MAP_HOST_ENV,
            GRAPHS_ENV,
            GRAPH_SPLIT_ENV,
            MMA_ENV,
            MMQ_ENV,
            INT8_TOKENS_ENV,
            ATTN_TILES_ENV,
            ATTN_SPLIT_ENV,
            FUSE_ENV,
            MATVEC_ROWS_ENV,
            I8_WPR_ENV,
            MMQ_PREFETCH_ENV,
        ];
        assert_eq!(vars.len(), CUDA_MODES.len());
        for (m, v) in CUDA_MODES.iter().zip(vars) {
            assert_eq!(m.var, v, "{}", m.key);
        }
        // Each default, given explicitly, opens the options the unset variables give.
        let unset = CudaOptions::from_vars(&|_| None).unwrap();
        let explicit =
            CudaOptions::from_vars(&|name| CUDA_MODES.iter().find(|m| m.var == name).map(|m| m.default.to_string()))
                .unwrap();
        assert_eq!(format!("{unset:?}"), format!("{explicit:?}"));
    }
}
