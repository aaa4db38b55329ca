//! Every example in conf/ is valid (`tokengate check` exits 0), and a bad config exits 1 with
//! every error named by its YAML path.

use std::process::Command;

fn check(path: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tokengate"))
        .args(["check", "-c"])
        .arg(path)
        .output()
        .expect("run tokengate check")
}

#[test]
fn every_conf_example_is_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("conf");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
            let out = check(&p);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{}: {err}", p.display());
            // Examples name the hosts of a deployment (engines.internal, compose service
            // names) that do not resolve here; `check` warns about those and nothing else.
            assert!(
                !err.lines()
                    .any(|l| l.contains("warning:") && !l.contains("cannot resolve")),
                "{}: {err}",
                p.display()
            );
            n += 1;
        }
    }
    assert!(n >= 2, "expected the conf/ examples, found {n}");
}

#[test]
fn a_bad_config_names_every_error_by_path() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.yaml");
    std::fs::write(
        &p,
        "services:\n  - name: a\n    instances:\n      - {id: x, addr: 127.0.0.1:1}\n  - name: b\n    instances:\n      - {id: y, addr: not-an-address}\ntimeouts: {connect: 0s}\n",
    )
    .unwrap();
    let out = check(&p);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    for want in [
        "services[1].instances[0].addr: invalid socket address \"not-an-address\"",
        "timeouts.connect: must be greater than 0",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
    // An enum-like key with an unknown name: its path and the accepted names.
    std::fs::write(
        &p,
        "services:\n  - name: b\n    load_balancing: fastest\n    instances:\n      - {id: y, addr: 127.0.0.1:1}\n",
    )
    .unwrap();
    let out = check(&p);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("services[0].load_balancing: `fastest` is not one of `least-token`, `least-request`, `round-robin`, `predicted-ttft`"),
        "{err}"
    );
    std::fs::write(&p, "services: []\nlisten: [1.2.3.4:5]\nbogus: 1\n").unwrap();
    let out = check(&p);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bogus: unknown key `bogus`"), "{err}");
}

#[test]
fn serve_refuses_a_bad_config_with_the_same_errors() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.yaml");
    std::fs::write(&p, "services:\n  - name: a\n    instances: []\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tokengate"))
        .args(["serve", "-c"])
        .arg(&p)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("services[0].instances: at least one instance is required"));
}
