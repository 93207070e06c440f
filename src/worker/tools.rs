//! The tools a worker advertises: an allowlist filtered by what really is
//! on `$PATH`, resolved once at start-up to absolute paths.

use std::{
    collections::HashMap,
    ffi::OsStr,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

/// Default allowlist of `--tools`: text tools that neither start other
/// programs nor write files by design. Tools that do (`awk`, `sed`,
/// `xargs`, `tee`, `find`, `env`, `timeout`, `nice`, `tar`, interpreters)
/// must be named in `--tools`; the sandbox is what contains them.
pub const DEFAULT_TOOLS: &[&str] = &[
    "sort",
    "uniq",
    "grep",
    "cut",
    "tr",
    "wc",
    "head",
    "tail",
    "cat",
    "jq",
    "paste",
    "join",
    "comm",
    "fold",
    "nl",
    "rev",
    "tac",
    "md5sum",
    "sha256sum",
    "sleep",
    "echo",
    "true",
    "false",
    "printf",
    "basename",
    "dirname",
    "date",
    "seq",
    "expand",
];

/// The advertised tools: bare names, each resolved to the executable that
/// runs when a task names it.
#[derive(Debug, Clone, Default)]
pub struct ToolSet {
    /// Names in allowlist order, without duplicates.
    names: Vec<String>,
    /// Name → absolute path of the executable found on `$PATH`.
    paths: HashMap<String, PathBuf>,
}

impl ToolSet {
    /// Resolves `allowlist` against the directories of `path_var` (a
    /// `$PATH`-style, colon-separated list). Names that contain `/`, are
    /// empty, or have no executable regular file on the path are dropped;
    /// duplicates keep their first position.
    pub fn resolve<I, S>(allowlist: I, path_var: Option<&OsStr>) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let dirs: Vec<PathBuf> = path_var
            .map(|p| std::env::split_paths(p).collect())
            .unwrap_or_default();
        let mut set = Self::default();
        for name in allowlist {
            let name = name.as_ref().trim();
            if name.is_empty() || name.contains('/') || set.paths.contains_key(name) {
                continue;
            }
            if let Some(path) = dirs
                .iter()
                .filter(|d| d.is_absolute())
                .map(|d| d.join(name))
                .find(|p| is_executable(p))
            {
                set.names.push(name.to_owned());
                set.paths.insert(name.to_owned(), path);
            }
        }
        set
    }

    /// Resolves `allowlist` against this process's `$PATH`.
    pub fn from_env<I, S>(allowlist: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self::resolve(allowlist, std::env::var_os("PATH").as_deref())
    }

    /// The tools of this set named in `keep`, in this set's order.
    pub fn subset(&self, keep: &[String]) -> Self {
        let mut set = Self::default();
        for name in &self.names {
            if keep.contains(name) {
                if let Some(p) = self.paths.get(name) {
                    set.names.push(name.clone());
                    set.paths.insert(name.clone(), p.clone());
                }
            }
        }
        set
    }

    /// Adds `name` run by the executable `path` (an agentic unit), after
    /// the others; a name already in the set keeps its executable.
    pub fn add(&mut self, name: &str, path: PathBuf) {
        if !self.paths.contains_key(name) {
            self.names.push(name.to_owned());
            self.paths.insert(name.to_owned(), path);
        }
    }

    /// The advertised names, in allowlist order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The executable for `name`, or `None` when it is not advertised.
    pub fn path(&self, name: &str) -> Option<&Path> {
        self.paths.get(name).map(PathBuf::as_path)
    }

    /// True when `name` is advertised.
    pub fn contains(&self, name: &str) -> bool {
        self.paths.contains_key(name)
    }

    /// Number of advertised tools.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// True when no tool is advertised.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}

/// True when `p` is a regular file (following symlinks) with an execute bit.
fn is_executable(p: &Path) -> bool {
    std::fs::metadata(p)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_by_path_and_keeps_order() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("mytool");
        std::fs::write(&exe, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        let plain = dir.path().join("notexec");
        std::fs::write(&plain, "").unwrap();
        let path = std::env::join_paths([dir.path()]).unwrap();
        let set = ToolSet::resolve(
            ["notexec", "mytool", "missing", "mytool", "a/b", ""],
            Some(&path),
        );
        assert_eq!(set.names(), ["mytool".to_owned()]);
        assert_eq!(set.path("mytool"), Some(exe.as_path()));
        assert!(!set.contains("notexec"));
        assert_eq!(set.len(), 1);
    }

    #[test]
    fn default_tools_found_on_this_machine() {
        let set = ToolSet::from_env(DEFAULT_TOOLS);
        for t in ["sort", "uniq", "cat", "sleep"] {
            assert!(set.contains(t), "{t} should be on PATH");
        }
    }
}
