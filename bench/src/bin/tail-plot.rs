//! `tail-plot SPEC.json OUT.svg`: draws a cross-run plot ([`tokengate_bench::plot::PlotSpec`])
//! with the bench crate's plot code; `bench/tail.sh` writes the specs.

use anyhow::{bail, Context};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [spec, out] = args.as_slice() else {
        bail!("usage: tail-plot SPEC.json OUT.svg");
    };
    let text = std::fs::read_to_string(spec).with_context(|| format!("reading {spec}"))?;
    let spec: tokengate_bench::plot::PlotSpec =
        serde_json::from_str(&text).with_context(|| format!("parsing {spec}"))?;
    std::fs::write(out, spec.to_svg()?).with_context(|| format!("writing {out}"))
}
