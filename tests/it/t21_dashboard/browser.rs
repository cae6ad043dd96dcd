//! Headless Chromium for the dashboard tests: loads a page, lets its scripts run, and keeps the
//! DOM they left and a screenshot as artefacts under the target directory.
//!
//! Chromium runs its scripts in virtual time (`--virtual-time-budget`): timers run as fast as
//! the page allows, and virtual time stands still while a network fetch is pending, so the
//! dumped DOM is the page after its fetches answered and it drew them, without a wall-clock
//! wait. Each run has a wall-clock bound and is killed past it.
//!
//! Where no browser is found the tests skip with a message, unless `VGPU_BROWSER_REQUIRED` is
//! set (`.ci/run` sets it after installing Debian's `chromium`): then a missing browser fails.

use anyhow::{Context, Result, bail, ensure};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Longest one page load may take, Chromium's start included.
const RUN_TIMEOUT: Duration = Duration::from_secs(60);
/// Virtual time the page's scripts get: one poll of its view, and then some.
const VIRTUAL_TIME_BUDGET_MS: u32 = 3_000;
/// The screenshot's size.
const WINDOW: &str = "1280,1000";

pub struct Browser {
    binary: PathBuf,
    /// Artefacts (DOM dumps, screenshots, logs) and browser profiles go here.
    pub artefacts: PathBuf,
}

/// One page as the browser left it.
pub struct Rendered {
    pub dom: String,
    /// Wall-clock time of the whole run: the browser's start, the page's fetches and drawing.
    pub wall: Duration,
    pub screenshot: PathBuf,
}

/// A started run (see [`Browser::start`]).
pub struct Loading {
    child: Child,
    started: Instant,
    dom: PathBuf,
    log: PathBuf,
    screenshot: PathBuf,
}

impl Drop for Loading {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn works(binary: &Path) -> bool {
    Command::new(binary)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

impl Browser {
    /// The browser named by `VGPU_CHROMIUM`, or the first of `chromium`, `chromium-browser`,
    /// `google-chrome` on the PATH that starts. `None` (after saying so on stderr) where there
    /// is none and none is required; an error where `VGPU_BROWSER_REQUIRED` is set.
    pub fn find(test: &str) -> Result<Option<Browser>> {
        let named = std::env::var_os("VGPU_CHROMIUM").map(PathBuf::from);
        let candidates = named.into_iter().chain(
            ["chromium", "chromium-browser", "google-chrome"]
                .into_iter()
                .map(PathBuf::from),
        );
        let found = candidates.into_iter().find(|binary| works(binary));
        let Some(binary) = found else {
            if std::env::var_os("VGPU_BROWSER_REQUIRED").is_some() {
                bail!(
                    "{test}: VGPU_BROWSER_REQUIRED is set but no browser starts (tried $VGPU_CHROMIUM, chromium, chromium-browser, google-chrome)"
                );
            }
            eprintln!(
                "SKIPPED {test}: no headless browser here (install Debian's `chromium`, or name one in VGPU_CHROMIUM; .ci/run installs it and sets VGPU_BROWSER_REQUIRED)"
            );
            return Ok(None);
        };
        let target = tests::binaries()
            .parent()
            .context("the profile directory sits in the target directory")?;
        let artefacts = target.join("artefacts").join(test);
        std::fs::create_dir_all(&artefacts)?;
        Ok(Some(Browser { binary, artefacts }))
    }

    /// Starts loading `url`; `name` names its artefacts (`NAME.html`, `NAME.png`, `NAME.log`).
    pub fn start(&self, url: &str, name: &str) -> Result<Loading> {
        let dom = self.artefacts.join(format!("{name}.html"));
        let log = self.artefacts.join(format!("{name}.log"));
        let screenshot = self.artefacts.join(format!("{name}.png"));
        let profile = self.artefacts.join(format!("{name}.profile"));
        let _ = std::fs::remove_file(&screenshot);
        let _ = std::fs::remove_dir_all(&profile);
        let mut command = Command::new(&self.binary);
        command
            .args(["--headless", "--disable-gpu", "--no-first-run"])
            // Root in a container has no user namespace for the sandbox; the page is our own.
            .arg("--no-sandbox")
            .arg("--hide-scrollbars")
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg(format!("--window-size={WINDOW}"))
            .arg(format!("--virtual-time-budget={VIRTUAL_TIME_BUDGET_MS}"))
            .arg(format!("--screenshot={}", screenshot.display()))
            .arg("--dump-dom")
            .arg(url)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&dom)?)
            .stderr(std::fs::File::create(&log)?);
        let started = Instant::now();
        let child = command
            .spawn()
            .with_context(|| format!("starting {}", self.binary.display()))?;
        Ok(Loading {
            child,
            started,
            dom,
            log,
            screenshot,
        })
    }

    /// Loads `url` and returns the DOM its scripts left (see [`Browser::start`]).
    pub fn render(&self, url: &str, name: &str) -> Result<Rendered> {
        self.start(url, name)?.finish()
    }
}

impl Loading {
    /// Waits for the browser to exit (at most [`RUN_TIMEOUT`] after its start).
    pub fn finish(mut self) -> Result<Rendered> {
        let deadline = self.started + RUN_TIMEOUT;
        let status = loop {
            if let Some(status) = self.child.try_wait()? {
                break status;
            }
            if Instant::now() >= deadline {
                bail!(
                    "the browser did not finish {} within {RUN_TIMEOUT:?}; its log:\n{}",
                    self.dom.display(),
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let wall = self.started.elapsed();
        let dom = std::fs::read_to_string(&self.dom)?;
        ensure!(
            status.success() && dom.contains("</html>"),
            "the browser failed ({status}) on {}; its log:\n{}",
            self.dom.display(),
            std::fs::read_to_string(&self.log).unwrap_or_default()
        );
        ensure!(
            self.screenshot.exists(),
            "no screenshot at {}",
            self.screenshot.display()
        );
        Ok(Rendered {
            dom,
            wall,
            screenshot: self.screenshot.clone(),
        })
    }
}

/// How often `needle` occurs in `haystack`.
pub fn count(haystack: &str, needle: &str) -> usize {
    haystack.matches(needle).count()
}
