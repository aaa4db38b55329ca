//! Stamps the binary with its git commit and build profile (`tokengate --version`). Outside a
//! git checkout (a Docker build copies the sources without `.git`), the commit is "unknown".

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let commit = git(&["rev-parse", "--short", "HEAD"]);
    if commit.is_some() {
        // A new commit or checkout moves HEAD (its reflog is appended to either way).
        if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
            for f in ["HEAD", "logs/HEAD"] {
                let p = std::path::Path::new(&dir).join(f);
                if p.exists() {
                    println!("cargo:rerun-if-changed={}", p.display());
                }
            }
        }
    }
    let commit = commit.unwrap_or_else(|| "unknown".into());
    // OUT_DIR is target/[TRIPLE/]PROFILE/build/PKG-HASH/out: the profile's own name (`dist`
    // too, where PROFILE says only "release").
    let profile = std::env::var("OUT_DIR")
        .ok()
        .and_then(|d| {
            std::path::Path::new(&d)
                .ancestors()
                .nth(3)
                .and_then(|p| p.file_name())
                .map(|n| n.to_string_lossy().to_string())
        })
        .or_else(|| std::env::var("PROFILE").ok())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=TOKENGATE_GIT_COMMIT={commit}");
    println!("cargo:rustc-env=TOKENGATE_BUILD_PROFILE={profile}");
}
