//! `ddo bench --plot PREFIX` end to end: both `PREFIX.svg` and `PREFIX.png` are written,
//! the SVG is text with one label per candidate, and the PNG has the PNG signature and the
//! size the chart is drawn at.

use std::process::Command;

#[test]
fn bench_plot_writes_svg_and_png() {
    // Created exclusively under a random name, removed when the test ends.
    let d = tempfile::Builder::new()
        .prefix("ddo-cli-plot-")
        .tempdir()
        .unwrap();
    let prefix = d.path().join("p");
    let routes = [
        "none",
        "diffusers_group_offload:offload_type=leaf_level,use_stream=false",
    ];
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ddo"));
    cmd.args([
        "bench",
        "--config",
        "tiny",
        "--height",
        "32",
        "--width",
        "32",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--plot",
        prefix.to_str().unwrap(),
    ]);
    for r in routes {
        cmd.args(["--route", r]);
    }
    cmd.args(["--preset", "auto"]);
    let out = cmd.output().expect("run ddo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("p.svg") && stdout.contains("p.png"),
        "{stdout}"
    );

    let svg = std::fs::read_to_string(d.path().join("p.svg")).expect("p.svg is text");
    assert!(svg.contains("<svg"), "{svg}");
    for label in routes.iter().copied().chain(["preset auto"]) {
        assert!(svg.contains(label), "no label `{label}` in the SVG");
    }
    assert!(svg.contains("peak device memory (MiB)") && svg.contains("median time (ms)"));
    assert!(svg.contains("transformer"), "caption names the component");

    let png = std::fs::read(d.path().join("p.png")).expect("p.png");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "PNG signature");
    // IHDR: width and height, big-endian, at bytes 16..24.
    let w = u32::from_be_bytes(png[16..20].try_into().unwrap());
    let h = u32::from_be_bytes(png[20..24].try_into().unwrap());
    assert!(
        (640..=4096).contains(&w) && (480..=4096).contains(&h),
        "{w}x{h}"
    );
    assert!(png.len() > 4096, "a drawn chart, not an empty image");
}
