//! The CUDA device's modes in one place. Each is set by `--cuda-opt KEY=VALUE` (repeatable, on
//! every command that opens a device), or for scripts and CI by one variable,
//! `GATESTREAM_CUDA_OPTS=KEY=VALUE,KEY=VALUE`; a mode's own variable (`GATESTREAM_CUDA_<KEY>`)
//! still works, and `--cuda-opt` wins over `GATESTREAM_CUDA_OPTS`, which wins over it. Two
//! settings are ordinary flags instead ([`CUDA_FLAGS`]: `--activations`, `--map-host`), which
//! win over their variables; `--cuda-opt` refuses their keys naming the flag.
//! `--cuda-opt help` prints the tables below: each mode's values and default. The device parses
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

/// A device setting that is a flag of its own on every command that opens a device, not a
/// `--cuda-opt` key: the key `--cuda-opt` refuses for it, the flag, the variable it sets (still
/// read when the flag is not given), its values and its default.
pub struct CudaFlag {
    pub key: &'static str,
    pub flag: &'static str,
    pub var: &'static str,
    pub values: &'static str,
    pub default: &'static str,
    pub what: &'static str,
}

/// The settings that are flags of their own, in the order `--cuda-opt help` prints them.
pub const CUDA_FLAGS: &[CudaFlag] = &[
    CudaFlag {
        key: "activations",
        flag: "--activations",
        var: "GATESTREAM_CUDA_ACTIVATIONS",
        values: "auto, f32, q8, int8",
        default: "auto",
        what: "what quantized products multiply: auto = int8 for Q4_K/Q6_K, f32 for the rest",
    },
    CudaFlag {
        key: "map-host",
        flag: "--map-host",
        var: "GATESTREAM_CUDA_MAP_HOST",
        values: "on, off",
        default: "on",
        what: "--vram-budget's neuron cache mapped: masked decode reads kept rows in place",
    },
];

/// The variable holding several modes at once.
pub const CUDA_OPTS_ENV: &str = "GATESTREAM_CUDA_OPTS";

/// Every mode, in the order `--cuda-opt help` prints them.
pub const CUDA_MODES: &[CudaMode] = &[
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
    let (kw, vw, dw) = (
        width(CUDA_MODES, |m| m.key, "mode"),
        width(CUDA_MODES, |m| m.values, "values"),
        width(CUDA_MODES, |m| m.default, "default"),
    );
    let mut s = format!(
        "CUDA device modes: --cuda-opt KEY=VALUE (repeatable), or {CUDA_OPTS_ENV}=KEY=VALUE,KEY=VALUE\n\n\
         {:kw$}  {:vw$}  {:dw$}  what\n",
        "mode", "values", "default"
    );
    for m in CUDA_MODES {
        s += &format!("{:kw$}  {:vw$}  {:dw$}  {}\n", m.key, m.values, m.default, m.what);
    }
    let (fw, vw) = (
        width(CUDA_FLAGS, |f| f.flag, "flag"),
        width(CUDA_FLAGS, |f| f.values, "values"),
    );
    s += &format!(
        "\nFlags of their own (not --cuda-opt keys; each over its variable):\n\n{:fw$}  {:vw$}  {:dw$}  what\n",
        "flag", "values", "default"
    );
    for f in CUDA_FLAGS {
        s += &format!(
            "{:fw$}  {:vw$}  {:dw$}  {} ({})\n",
            f.flag, f.values, f.default, f.what, f.var
        );
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
            if let Some(f) = CUDA_FLAGS.iter().find(|f| f.key == k.trim()) {
                return Err(Error::Input(format!(
                    "{from} {item:?}: {} is not a --cuda-opt mode but a flag of its own: {} {} (values: {}; or {}={})",
                    f.key,
                    f.flag,
                    flag_value(f, v.trim()),
                    f.values,
                    f.var,
                    v.trim()
                )));
            }
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

/// The width of a help table's column: its longest `field` in `rows`, or its `head`.
fn width<T>(rows: &[T], field: fn(&T) -> &str, head: &str) -> usize {
    rows.iter().map(|r| field(r).len()).max().unwrap_or(0).max(head.len())
}

/// What to give flag `f` for `value` (a `--cuda-opt` item's): the value as such where the flag
/// takes it (a switch's `1` and `0` as `on` and `off`), else the flag's values.
fn flag_value(f: &CudaFlag, value: &str) -> String {
    let value = match (f.values, value) {
        ("on, off", "1") => "on",
        ("on, off", "0") => "off",
        _ => value,
    };
    if f.values.split(", ").any(|v| v == value) {
        value.to_string()
    } else {
        format!("<{}>", f.values.replace(", ", "|"))
    }
}

/// The variables the CUDA device reads, with `flags` (the [`CUDA_FLAGS`] given: key and value)
/// over `cli` (`--cuda-opt` items) over `GATESTREAM_CUDA_OPTS` (read through `env`) over the
/// modes' own variables.
pub fn with_opts<'a>(
    cli: &[String],
    flags: &[(&str, String)],
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
    for (key, value) in flags {
        let f = CUDA_FLAGS
            .iter()
            .find(|f| f.key == *key)
            .ok_or_else(|| Error::Input(format!("no CUDA flag {key:?}")))?;
        set.push((f.var, value.clone()));
    }
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
        let var = with_opts(&cli, &[], &env).unwrap();
        assert_eq!(var("GATESTREAM_CUDA_FUSE").as_deref(), Some("1"));
        assert_eq!(var("GATESTREAM_CUDA_GRAPHS").as_deref(), Some("1"));
        assert_eq!(var("GATESTREAM_CUDA_INT8_TOKENS").as_deref(), Some("4"));
        assert_eq!(var("GATESTREAM_CUDA_MMA").as_deref(), Some("0"));
        assert_eq!(var("GATESTREAM_CUDA_ATTN_SPLIT"), None);
        let e = with_opts(&["fusion=1".to_string()], &[], &env)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("--cuda-opt") && e.contains("\"fusion\"") && e.contains("fuse"),
            "{e}"
        );
        let e = with_opts(&["fuse".to_string()], &[], &env).err().unwrap().to_string();
        assert!(e.contains("KEY=VALUE"), "{e}");
        let bad = |n: &str| (n == CUDA_OPTS_ENV).then(|| "mma=1,x=2".to_string());
        let e = with_opts(&[], &[], &bad).err().unwrap().to_string();
        assert!(e.contains(CUDA_OPTS_ENV) && e.contains("\"x\""), "{e}");
    }

    /// `--activations` and `--map-host` win over their variables; unset, the variables still
    /// count; as `--cuda-opt` keys (or in `GATESTREAM_CUDA_OPTS`) they are refused naming the flag.
    #[test]
    fn flags_win_over_their_variables_and_are_no_cuda_opt_keys() {
        let env = |name: &str| match name {
            "GATESTREAM_CUDA_ACTIVATIONS" => Some("q8".to_string()),
            "GATESTREAM_CUDA_MAP_HOST" => Some("0".to_string()),
            _ => None,
        };
        let var = with_opts(&[], &[], &env).unwrap();
        assert_eq!(var("GATESTREAM_CUDA_ACTIVATIONS").as_deref(), Some("q8"));
        assert_eq!(var("GATESTREAM_CUDA_MAP_HOST").as_deref(), Some("0"));
        let flags = [("activations", "int8".to_string()), ("map-host", "on".to_string())];
        let var = with_opts(&[], &flags, &env).unwrap();
        assert_eq!(var("GATESTREAM_CUDA_ACTIVATIONS").as_deref(), Some("int8"));
        assert_eq!(var("GATESTREAM_CUDA_MAP_HOST").as_deref(), Some("on"));
        for (item, flag) in [
            ("activations=int8", "--activations int8"),
            ("map-host=0", "--map-host off"),
            ("activations=i8", "--activations <auto|f32|q8|int8>"),
        ] {
            let e = with_opts(&[item.to_string()], &[], &env).err().unwrap().to_string();
            assert!(
                e.contains("--cuda-opt") && e.contains(flag) && e.contains("flag of its own"),
                "{e}"
            );
        }
        let opts = |n: &str| (n == CUDA_OPTS_ENV).then(|| "graphs=1,activations=f32".to_string());
        let e = with_opts(&[], &[], &opts).err().unwrap().to_string();
        assert!(
            e.contains(CUDA_OPTS_ENV)
                && e.contains("--activations f32")
                && e.contains("GATESTREAM_CUDA_ACTIVATIONS=f32"),
            "{e}"
        );
        assert!(CUDA_FLAGS
            .iter()
            .all(|f| CUDA_MODES.iter().all(|m| m.key != f.key && m.var != f.var)));
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
        for f in CUDA_FLAGS {
            assert!(
                h.lines()
                    .any(|l| l.starts_with(f.flag) && l.contains(f.values) && l.contains(f.default)),
                "{}",
                f.flag
            );
        }
    }

    /// The table names the variables the device reads, and its defaults are the device's.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_table_matches_the_device_s_variables_and_defaults() {
        use crate::backend::cuda::*;
        let vars = [
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
        let flag_vars = [ACTIVATIONS_ENV, MAP_HOST_ENV];
        assert_eq!(flag_vars.len(), CUDA_FLAGS.len());
        for (f, v) in CUDA_FLAGS.iter().zip(flag_vars) {
            assert_eq!(f.var, v, "{}", f.flag);
        }
        // Each default, given explicitly, opens the options the unset variables give.
        let unset = CudaOptions::from_vars(&|_| None).unwrap();
        let explicit = CudaOptions::from_vars(&|name| {
            let mode = CUDA_MODES.iter().find(|m| m.var == name).map(|m| m.default);
            mode.or_else(|| CUDA_FLAGS.iter().find(|f| f.var == name).map(|f| f.default))
                .map(String::from)
        })
        .unwrap();
        assert_eq!(format!("{unset:?}"), format!("{explicit:?}"));
    }
}
