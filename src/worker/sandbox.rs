//! The kernel sandbox around every task `agw` runs.
//!
//! A client token may submit any Plan with any input, so a task is
//! untrusted code running through a trusted tool. Between `fork` and `exec`
//! the child is confined, in this order:
//!
//! 1. **user**: when `agw` runs as root, the child switches to an
//!    unprivileged uid/gid (`--run-as`, default `nobody`) and drops every
//!    supplementary group; a task never runs as root;
//! 2. **resource limits** (`setrlimit`): address space, file size, number of
//!    processes of the task's uid, CPU seconds;
//! 3. **Landlock** (Linux ≥ 6.2, ABI ≥ 3 required; newer rights are used
//!    when the kernel has them):
//!    - *execute* only the resolved executables of the advertised tools and
//!      the dynamic loaders they name (`PT_INTERP`), so `awk system()`,
//!      `sed e`, `sort --compress-program` and `xargs sh` fail at `exec`;
//!    - *write* only beneath the job's scratch directory and to the
//!      harmless devices (`/dev/null`, `/dev/zero`, `/dev/full`);
//!    - *read* only the operator's read paths (`--read-path`, defaulting to
//!      what the tools themselves need) and the scratch directory;
//!    - no TCP bind or connect (ABI ≥ 4), no abstract UNIX socket or signal
//!      outside the sandbox (ABI ≥ 6);
//! 4. **seccomp**: `socket(2)` of any family, UNIX included, and
//!    `io_uring` fail with `EACCES`, so UDP, raw sockets, named UNIX
//!    sockets (a system bus, a container engine's socket) and io_uring's
//!    own socket path are closed too (unless `--allow-network`); so do
//!    System V IPC (shared memory, message queues, semaphores), POSIX
//!    message queues and the kernel keyrings, whose objects outlive the
//!    task, count against none of its limits and are reachable by id or
//!    name from outside its sandbox (another job's task included);
//! 5. **descriptors**: every descriptor but standard input, output and
//!    error is closed at `exec` ([`close_inherited_descriptors`]).
//!
//! The whole set is applied by async-signal-safe calls only (no allocation
//! after `fork`): everything is built in the parent per job, the child only
//! issues the system calls. A kernel without Landlock ABI 3 makes
//! [`probe`] fail, and `agw` refuses to start unless the operator passes
//! `--insecure-no-sandbox` (see [`crate::worker::config`]).

use std::{
    collections::BTreeMap,
    io,
    os::unix::{ffi::OsStrExt, fs::PermissionsExt},
    path::{Path, PathBuf},
    sync::Arc,
};

use landlock::{
    Access, AccessFs, AccessNet, CompatLevel, Compatible, PathBeneath, PathFd, Ruleset,
    RulesetAttr, RulesetCreated, RulesetCreatedAttr, Scope, ABI,
};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule,
};

use super::tools::ToolSet;

/// Paths a task may read by default: what the tools themselves need (their
/// binaries and libraries, the loader's cache, locale and time-zone data).
pub const DEFAULT_READ_PATHS: &[&str] = &[
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/locale.alias",
    "/etc/localtime",
];

/// Devices a task may open for reading and writing.
const DEVICES_RW: &[&str] = &["/dev/null", "/dev/zero", "/dev/full"];

/// Devices a task may open for reading.
const DEVICES_RO: &[&str] = &["/dev/urandom", "/dev/random"];

/// Environment variable that makes [`probe`] report Landlock as missing,
/// so the fail-closed start-up can be tested on any kernel. Only ever
/// lowers protection checks to a refusal; it cannot weaken a sandbox.
pub const PROBE_OVERRIDE_ENV: &str = "AGW_SANDBOX_PROBE";

/// Per-task resource limits (`setrlimit`), applied to every task whether or
/// not Landlock is on. `0` leaves a limit as inherited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResourceLimits {
    /// `RLIMIT_AS`: address space, bytes.
    pub address_space_bytes: u64,
    /// `RLIMIT_FSIZE`: largest file a task may write, bytes; also the most
    /// stdout agw keeps for a later task to read.
    pub file_size_bytes: u64,
    /// `RLIMIT_NPROC`: processes (and threads) of the task's uid.
    pub processes: u64,
    /// `RLIMIT_CPU`: CPU time, seconds.
    pub cpu_secs: u64,
    /// `RLIMIT_NOFILE`: descriptors each task process may hold open (a
    /// task cannot raise it: soft and hard limit alike).
    pub open_files: u64,
}

impl Default for ResourceLimits {
    fn default() -> Self {
        ResourceLimits {
            address_space_bytes: 4 << 30,
            file_size_bytes: 1 << 30,
            processes: 256,
            cpu_secs: 86_400,
            open_files: 1024,
        }
    }
}

/// The unprivileged identity tasks run as when `agw` is root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunAs {
    /// User id (never 0).
    pub uid: u32,
    /// Group id (never 0).
    pub gid: u32,
}

/// What the operator configured for the sandbox.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// Confine tasks with Landlock and seccomp (false only with
    /// `--insecure-no-sandbox`).
    pub enabled: bool,
    /// Paths (directories or files) tasks may read.
    pub read_paths: Vec<PathBuf>,
    /// Let tasks use the network.
    pub allow_network: bool,
    /// Per-task resource limits.
    pub limits: ResourceLimits,
    /// The identity tasks run as (set when `agw` is root).
    pub run_as: Option<RunAs>,
    /// Directory under which each job gets its scratch directory.
    pub scratch_root: PathBuf,
}

/// Why the sandbox cannot be set up.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The kernel lacks what the sandbox needs.
    #[error("the kernel cannot sandbox tasks: {0}")]
    Unsupported(String),
    /// A setting is unusable.
    #[error("{0}")]
    Config(String),
    /// A file system or system call error while building it.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        source: io::Error,
    },
}

/// The minimum Landlock ABI: execute, read, write, make, remove, refer and
/// truncate rights (Linux 6.2).
const REQUIRED_ABI: ABI = ABI::V3;

/// The newest ABI whose rights are used when the kernel has them.
const WANTED_ABI: ABI = ABI::V7;

/// Checks that the kernel can enforce the sandbox (Landlock ABI ≥ 3).
///
/// Honors [`PROBE_OVERRIDE_ENV`]` = unsupported` (for tests of the
/// fail-closed start-up).
///
/// # Errors
///
/// [`SandboxError::Unsupported`] saying what is missing.
pub fn probe() -> Result<(), SandboxError> {
    if std::env::var_os(PROBE_OVERRIDE_ENV).is_some_and(|v| v == "unsupported") {
        return Err(SandboxError::Unsupported(format!(
            "Landlock reported unsupported ({PROBE_OVERRIDE_ENV}=unsupported)"
        )));
    }
    Ruleset::default()
        .set_compatibility(CompatLevel::HardRequirement)
        .handle_access(AccessFs::from_all(REQUIRED_ABI))
        .and_then(|r| r.create())
        .map(|_| ())
        .map_err(|e| {
            SandboxError::Unsupported(format!(
                "Landlock ABI {} or newer is required (Linux 6.2+, enabled at boot): {e}",
                REQUIRED_ABI as i32
            ))
        })
}

/// Marks this process non-dumpable (`PR_SET_DUMPABLE` 0): its
/// `/proc/<pid>/environ`, `mem`, `fd` and the like become root-owned and
/// `ptrace` is refused, so a task running as the same user cannot read the
/// worker's token from them. Tasks start dumpable again at `exec`.
///
/// # Errors
///
/// The OS error of `prctl`.
pub fn make_undumpable() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The sandbox of one worker: the executables tasks may run and the
/// settings above, resolved once at start-up.
#[derive(Debug)]
pub struct Sandbox {
    config: SandboxConfig,
    /// Resolved tool executables plus the loaders they need.
    exec_paths: Vec<PathBuf>,
    /// Read paths that exist (missing defaults are skipped).
    read_paths: Vec<PathBuf>,
    /// The compiled seccomp filter (None with the sandbox off).
    seccomp: Option<Arc<BpfProgram>>,
}

impl Sandbox {
    /// Resolves the sandbox for `tools`: every tool's real executable and
    /// its dynamic loader. A script tool (`#!`) is kept only when its
    /// interpreter is itself an advertised tool; it is dropped from `tools`
    /// otherwise (returned in the second value, for a warning), since the
    /// sandbox would not let it start.
    ///
    /// # Errors
    ///
    /// [`SandboxError::Config`] for a read path that is not absolute or
    /// does not exist (a missing default is skipped), a scratch root that
    /// cannot be created; [`SandboxError::Io`] for file system errors.
    pub fn new(
        config: SandboxConfig,
        tools: &ToolSet,
    ) -> Result<(Self, ToolSet, Vec<String>), SandboxError> {
        let mut read_paths = Vec::new();
        for p in &config.read_paths {
            if !p.is_absolute() {
                return Err(SandboxError::Config(format!(
                    "--read-path {} must be an absolute path",
                    p.display()
                )));
            }
            if p.exists() {
                read_paths.push(p.clone());
            } else if !DEFAULT_READ_PATHS.iter().any(|d| Path::new(d) == p) {
                return Err(SandboxError::Config(format!(
                    "--read-path {} does not exist",
                    p.display()
                )));
            }
        }
        let (kept, dropped, exec_paths) = executables(tools);
        for (file, names) in shared_executables(&kept) {
            tracing::warn!(
                executable = %file.display(),
                tools = %names.join(","),
                "these tools are one executable (a multi-call binary such as busybox?): a task \
                 may run it under any of its names, every program it contains included"
            );
        }
        let mut config = config;
        config.scratch_root = create_scratch_root(&config)?;
        let seccomp = if config.enabled {
            Some(Arc::new(task_filter(config.allow_network)?))
        } else {
            None
        };
        Ok((
            Sandbox {
                config,
                exec_paths,
                read_paths,
                seccomp,
            },
            kept,
            dropped,
        ))
    }

    /// True when tasks are confined by Landlock and seccomp.
    pub fn enabled(&self) -> bool {
        self.config.enabled
    }

    /// The settings.
    pub fn config(&self) -> &SandboxConfig {
        &self.config
    }

    /// Creates a job's scratch directory under the scratch root, owned by
    /// the task identity, mode 0700. It is removed when the returned value
    /// is dropped, with whatever the job's tasks made in it, whatever
    /// permissions they left on it ([`ScratchDir`]).
    ///
    /// # Errors
    ///
    /// The file system error.
    pub fn scratch(&self) -> io::Result<ScratchDir> {
        use std::os::unix::fs::OpenOptionsExt;
        let dir = tempfile::Builder::new()
            .prefix("job-")
            .tempdir_in(&self.config.scratch_root)?;
        // Through a descriptor of the directory just made, not its path:
        // nothing on the way can send the change elsewhere.
        let fd = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
            .open(dir.path())?;
        fd.set_permissions(std::fs::Permissions::from_mode(0o700))?;
        if let Some(r) = self.config.run_as {
            std::os::unix::fs::fchown(&fd, Some(r.uid), Some(r.gid))?;
        }
        Ok(ScratchDir { path: dir.keep() })
    }

    /// Builds, once per job, what each task of a job with scratch
    /// directory `scratch` applies after `fork` (one
    /// [`Confinement::try_clone`] per task): the Landlock ruleset (opened
    /// here, in the parent), the seccomp filter and the limits.
    ///
    /// # Errors
    ///
    /// [`SandboxError`] when the ruleset cannot be built (it is not
    /// applied half: the task is not started).
    pub fn confinement(&self, scratch: &Path) -> Result<Confinement, SandboxError> {
        let ruleset = if self.config.enabled {
            Some(self.ruleset(scratch)?)
        } else {
            None
        };
        Ok(Confinement {
            ruleset,
            seccomp: self.seccomp.clone(),
            limits: self.config.limits,
        })
    }

    /// The Landlock ruleset for a job.
    fn ruleset(&self, scratch: &Path) -> Result<RulesetCreated, SandboxError> {
        let err = |e: landlock::RulesetError| {
            SandboxError::Unsupported(format!("cannot build the Landlock ruleset: {e}"))
        };
        let mut ruleset = Ruleset::default()
            .set_compatibility(CompatLevel::HardRequirement)
            .handle_access(AccessFs::from_all(REQUIRED_ABI))
            .map_err(err)?
            .set_compatibility(CompatLevel::BestEffort)
            .handle_access(AccessFs::from_all(WANTED_ABI))
            .map_err(err)?;
        if !self.config.allow_network {
            ruleset = ruleset
                .handle_access(AccessNet::BindTcp | AccessNet::ConnectTcp)
                .map_err(err)?;
        }
        ruleset = ruleset
            .scope(Scope::AbstractUnixSocket | Scope::Signal)
            .map_err(err)?;
        let mut created = ruleset.create().map_err(err)?;
        let read_dir = AccessFs::ReadFile | AccessFs::ReadDir;
        let all_but_exec = AccessFs::from_all(WANTED_ABI) & !AccessFs::Execute;
        let rw_file = AccessFs::ReadFile | AccessFs::WriteFile | AccessFs::Truncate;
        let mut rules: Vec<(PathBuf, landlock::BitFlags<AccessFs>)> = Vec::new();
        for p in &self.read_paths {
            let access = if p.is_dir() {
                read_dir
            } else {
                AccessFs::ReadFile.into()
            };
            rules.push((p.clone(), access));
        }
        for p in &self.exec_paths {
            rules.push((p.clone(), AccessFs::Execute | AccessFs::ReadFile));
        }
        for d in DEVICES_RW {
            rules.push((PathBuf::from(d), rw_file));
        }
        for d in DEVICES_RO {
            rules.push((PathBuf::from(d), AccessFs::ReadFile.into()));
        }
        rules.push((scratch.to_path_buf(), all_but_exec));
        for (path, access) in rules {
            let fd = match PathFd::new(&path) {
                Ok(fd) => fd,
                // A device or default that this system lacks: nothing to allow.
                Err(_) if !path.starts_with(scratch) && !path.exists() => continue,
                Err(e) => {
                    return Err(SandboxError::Config(format!(
                        "cannot open {} for the sandbox: {e}",
                        path.display()
                    )))
                }
            };
            created = created
                .set_compatibility(CompatLevel::BestEffort)
                .add_rule(PathBeneath::new(fd, access))
                .map_err(err)?;
        }
        Ok(created)
    }
}

/// A job's scratch directory, removed with everything in it when dropped.
///
/// A task owns what it makes there (and, when `agw` is not root, the
/// directory itself: tasks then run as `agw`'s user), so it can take the
/// permissions away: a subdirectory of mode 0, the directory read-only.
/// `agw`, without privilege over them, could then neither list nor
/// remove them, and the directory with its data would stay after the job.
/// So where a plain removal fails, every directory in the tree that
/// belongs to `agw`'s user gets its owner's read, write and search
/// permissions back (through descriptors opened without following links,
/// so nothing outside the tree is touched) and the removal is tried again.
#[derive(Debug)]
pub struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if let Err(e) = remove_tree(&self.path) {
            tracing::warn!(
                path = %self.path.display(),
                error = %e,
                "cannot remove a job's scratch directory"
            );
        }
    }
}

/// Most directories one pass of [`grant_owner_access`] visits, and most
/// descriptors it holds open at once.
const GRANT_MAX_DIRS: usize = 100_000;
const GRANT_MAX_OPEN: usize = 256;

/// Most passes of [`remove_tree`]: each grants what it can reach and
/// removes it, so a tree needs about one pass per [`GRANT_MAX_DIRS`]
/// directories locked away, and a pass that grants nothing ends it.
const REMOVE_MAX_PASSES: usize = 64;

/// Removes directory `path` with everything in it (a missing one is
/// fine); where that fails, gives the owner's permissions back to the
/// directories of the tree ([`grant_owner_access`]) and tries again, while
/// a pass still finds directories to give permissions back to (at most
/// [`REMOVE_MAX_PASSES`]).
fn remove_tree(path: &Path) -> io::Result<()> {
    let mut last = match std::fs::remove_dir_all(path) {
        Ok(()) => return Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => e,
    };
    for _ in 0..REMOVE_MAX_PASSES {
        if grant_owner_access(path) == 0 {
            return Err(last);
        }
        last = match std::fs::remove_dir_all(path) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => e,
        };
    }
    Err(last)
}

/// Gives every directory under (and including) `root` that belongs to
/// this process's user the owner's read, write and search permissions
/// (`u+rwx`), so that it can list and empty them. Each directory is opened
/// with `O_PATH | O_NOFOLLOW | O_DIRECTORY` relative to its parent's
/// descriptor and changed through `/proc/self/fd/N`, which names that very
/// directory: a link in the tree is never followed out of it. Best
/// effort: errors skip a directory. Directories met while
/// [`GRANT_MAX_OPEN`] descriptors are held are granted on the spot, and
/// what lies in them is left to the next pass. Returns how many
/// directories it gave permissions back to.
fn grant_owner_access(root: &Path) -> usize {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    fn open_dir(at: libc::c_int, name: &std::ffi::CStr) -> Option<OwnedFd> {
        // SAFETY: openat(2) on a C string we own; returns a new descriptor
        // or -1.
        let fd = unsafe {
            libc::openat(
                at,
                name.as_ptr(),
                libc::O_PATH | libc::O_NOFOLLOW | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        // SAFETY: a descriptor just returned to us, owned by nobody else.
        (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
    }
    // The owner's permissions back on directory `dir`, when it is ours
    // and lacks them; true when it changed. None when it is no directory.
    fn grant(dir: &OwnedFd, me: libc::uid_t) -> Option<bool> {
        // SAFETY: an all-zero stat is a valid value for fstat to fill.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat(2) writes only the struct we pass.
        if unsafe { libc::fstat(dir.as_raw_fd(), &mut st) } != 0
            || st.st_mode & libc::S_IFMT != libc::S_IFDIR
        {
            return None;
        }
        if st.st_uid != me || st.st_mode & 0o700 == 0o700 {
            return Some(false);
        }
        let here = format!("/proc/self/fd/{}", dir.as_raw_fd());
        let mode = (st.st_mode & 0o7777) | 0o700;
        Some(std::fs::set_permissions(&here, std::fs::Permissions::from_mode(mode)).is_ok())
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let Ok(root) = std::ffi::CString::new(root.as_os_str().as_bytes()) else {
        return 0;
    };
    let Some(first) = open_dir(libc::AT_FDCWD, &root) else {
        return 0;
    };
    let mut stack = vec![first];
    let (mut visited, mut granted) = (0, 0);
    while let Some(dir) = stack.pop() {
        visited += 1;
        if visited > GRANT_MAX_DIRS {
            break;
        }
        match grant(&dir, me) {
            None => continue,
            Some(changed) => granted += usize::from(changed),
        }
        let Ok(entries) = std::fs::read_dir(format!("/proc/self/fd/{}", dir.as_raw_fd())) else {
            continue;
        };
        for entry in entries.flatten() {
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let Ok(name) = std::ffi::CString::new(entry.file_name().as_bytes()) else {
                continue;
            };
            let Some(child) = open_dir(dir.as_raw_fd(), &name) else {
                continue;
            };
            if stack.len() < GRANT_MAX_OPEN {
                stack.push(child);
            } else {
                // Granted now, walked by the next pass.
                visited += 1;
                granted += usize::from(grant(&child, me) == Some(true));
            }
        }
    }
    granted
}

/// What one task applies between `fork` and `exec`.
#[derive(Debug)]
pub struct Confinement {
    ruleset: Option<RulesetCreated>,
    seccomp: Option<Arc<BpfProgram>>,
    limits: ResourceLimits,
}

impl Confinement {
    /// The same confinement for another task of the job: the Landlock
    /// ruleset is shared (its descriptor duplicated), not built again.
    ///
    /// # Errors
    ///
    /// The OS error of duplicating the ruleset's descriptor.
    pub fn try_clone(&self) -> io::Result<Confinement> {
        Ok(Confinement {
            ruleset: self
                .ruleset
                .as_ref()
                .map(RulesetCreated::try_clone)
                .transpose()?,
            seccomp: self.seccomp.clone(),
            limits: self.limits,
        })
    }

    /// Applies limits, Landlock and seccomp to the calling process. Meant
    /// for the child between `fork` and `exec`: it allocates nothing and
    /// only issues system calls. Callable once (the ruleset is consumed).
    ///
    /// # Errors
    ///
    /// The OS error of the first call that failed; the child must then not
    /// `exec` (the task fails to start: fail closed).
    pub fn apply(&mut self) -> io::Result<()> {
        let l = self.limits;
        set_limit(libc::RLIMIT_AS, l.address_space_bytes, 0)?;
        set_limit(libc::RLIMIT_FSIZE, l.file_size_bytes, 0)?;
        set_limit(libc::RLIMIT_NPROC, l.processes, 0)?;
        // One more second of hard limit: at the soft limit the task gets
        // SIGXCPU, which names the cause in the job's error; SIGKILL follows
        // a second later if it ignores that.
        set_limit(libc::RLIMIT_CPU, l.cpu_secs, 1)?;
        set_limit(libc::RLIMIT_NOFILE, l.open_files, 0)?;
        if let Some(ruleset) = self.ruleset.take() {
            match ruleset.restrict_self() {
                Ok(status) if status.ruleset != landlock::RulesetStatus::NotEnforced => {}
                Ok(_) => return Err(io::Error::from_raw_os_error(libc::ENOSYS)),
                Err(_) => return Err(io::Error::last_os_error()),
            }
        }
        if let Some(bpf) = &self.seccomp {
            seccompiler::apply_filter(bpf).map_err(|_| io::Error::last_os_error())?;
        }
        Ok(())
    }
}

/// `setrlimit(resource, …)`: soft limit `value`, hard limit `value +
/// hard_extra`, neither above the inherited hard limit; `value` 0 leaves
/// the resource alone.
fn set_limit(resource: libc::__rlimit_resource_t, value: u64, hard_extra: u64) -> io::Result<()> {
    if value == 0 {
        return Ok(());
    }
    let mut cur = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only the struct we pass.
    if unsafe { libc::getrlimit(resource, &mut cur) } == -1 {
        return Err(io::Error::last_os_error());
    }
    // Never above the inherited hard limit (an unprivileged agw cannot
    // raise it, and a lower one is stricter anyway).
    let lim = libc::rlimit {
        rlim_cur: value.min(cur.rlim_max),
        rlim_max: value.saturating_add(hard_extra).min(cur.rlim_max),
    };
    // SAFETY: setrlimit reads the struct we pass and nothing else.
    if unsafe { libc::setrlimit(resource, &lim) } == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The seccomp filter of a task. Unless `allow_network`, it closes the
/// network: `socket(2)` of every family (UNIX sockets included: a named
/// socket anywhere on the host, the system bus or a container engine's,
/// would be reachable, since Landlock does not govern `connect` to a
/// path) and `io_uring_setup(2)` fail with `EACCES`; `socketpair(2)`
/// stays. Always, System V IPC (`shmget`, `shmat`, `shmctl`, `msgget`,
/// `msgsnd`, `msgrcv`, `msgctl`, `semget`, `semop`, `semtimedop`,
/// `semctl`), POSIX message queues (`mq_*`) and the kernel keyrings
/// (`add_key`, `request_key`, `keyctl`) fail with `EACCES`: their objects
/// outlive the task (memory beyond `--max-address-space-mb` that stays
/// after the job; a key in the uid's user keyring that every later task of
/// that uid, another job's included, reads), and those of other programs
/// are reachable by id or name, outside Landlock's rules. Always too, the
/// calls that change a file's mode, owner or extended attributes by path
/// (`chmod`, `fchmodat`, `fchmodat2`, `chown`, `lchown`, `fchownat`,
/// `setxattr`, `lsetxattr`, `removexattr`, `lremovexattr`, `setxattrat`,
/// `removexattrat`) fail with `EACCES`: Landlock has no right for them,
/// so a task could open up a file it may not read (`agw`'s token, when
/// tasks run as `agw`'s user) anywhere it can name one; the calls on a
/// descriptor (`fchmod`, `fchown`, `fsetxattr`) stay, for what the task
/// could open. And `memfd_create` and `memfd_secret` fail: a file in
/// memory is outside Landlock's rules, so a program the task wrote there
/// could be run. The calls that change another process's resource
/// limits, nice value, scheduling policy or parameters, CPU affinity or
/// I/O priority (`prlimit64` with a pid, `setpriority` but on the caller
/// itself, `sched_setscheduler`, `sched_setparam`, `sched_setattr` and
/// `sched_setaffinity` with a pid, `ioprio_set` but on the caller itself)
/// fail too: the kernel allows them on every process of the same uid,
/// `agw` (whose open-file or CPU limit a task could drop to nothing) and
/// other jobs' tasks, and no Landlock right covers them; on the caller
/// itself (`setrlimit`, `nice`, `taskset` of a new command) they work. On
/// x86-64 the same calls through the x32 numbering (bit 30 set), which a
/// kernel built with x32 support accepts, fail too.
///
/// # Errors
///
/// [`SandboxError::Unsupported`] on an architecture seccompiler does not
/// know, [`SandboxError::Config`] when the filter cannot be compiled.
fn task_filter(allow_network: bool) -> Result<BpfProgram, SandboxError> {
    fn err(e: impl std::fmt::Display) -> SandboxError {
        SandboxError::Config(format!("seccomp filter: {e}"))
    }
    let arch = seccompiler::TargetArch::try_from(std::env::consts::ARCH)
        .map_err(|e| SandboxError::Unsupported(format!("seccomp on this architecture: {e}")))?;
    let mut refused = vec![
        libc::SYS_shmget,
        libc::SYS_shmat,
        libc::SYS_shmctl,
        libc::SYS_msgget,
        libc::SYS_msgsnd,
        libc::SYS_msgrcv,
        libc::SYS_msgctl,
        libc::SYS_semget,
        libc::SYS_semop,
        libc::SYS_semtimedop,
        libc::SYS_semctl,
        libc::SYS_mq_open,
        libc::SYS_mq_unlink,
        libc::SYS_mq_timedsend,
        libc::SYS_mq_timedreceive,
        libc::SYS_mq_notify,
        libc::SYS_mq_getsetattr,
        libc::SYS_add_key,
        libc::SYS_request_key,
        libc::SYS_keyctl,
        libc::SYS_fchmodat,
        libc::SYS_fchownat,
        libc::SYS_setxattr,
        libc::SYS_lsetxattr,
        libc::SYS_removexattr,
        libc::SYS_lremovexattr,
        libc::SYS_memfd_create,
        // Numbered alike on every architecture (the common table).
        SYS_MEMFD_SECRET,
        SYS_FCHMODAT2,
        SYS_SETXATTRAT,
        SYS_REMOVEXATTRAT,
    ];
    #[cfg(target_arch = "x86_64")]
    refused.extend([libc::SYS_chmod, libc::SYS_chown, libc::SYS_lchown]);
    if !allow_network {
        refused.extend([libc::SYS_socket, libc::SYS_io_uring_setup]);
    }
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for nr in refused {
        rules.insert(nr, vec![]);
        if cfg!(target_arch = "x86_64") {
            rules.insert(nr | X32_SYSCALL_BIT, vec![]);
        }
    }
    // The calls that set another process's limits, scheduling or I/O
    // priority are refused unless they name the caller (0): the kernel
    // lets any process of the same uid do them, and no Landlock right
    // covers them.
    let unless = |conds: &[(u8, u64)]| -> Result<Vec<SeccompRule>, SandboxError> {
        conds
            .iter()
            .map(|&(arg, value)| {
                let c =
                    SeccompCondition::new(arg, SeccompCmpArgLen::Dword, SeccompCmpOp::Ne, value)
                        .map_err(err)?;
                SeccompRule::new(vec![c]).map_err(err)
            })
            .collect()
    };
    const PRIO_PROCESS: u64 = 0;
    const IOPRIO_WHO_PROCESS: u64 = 1;
    for (nr, conds) in [
        (libc::SYS_prlimit64, &[(0, 0)][..]),
        (libc::SYS_setpriority, &[(0, PRIO_PROCESS), (1, 0)]),
        (libc::SYS_sched_setscheduler, &[(0, 0)]),
        (libc::SYS_sched_setparam, &[(0, 0)]),
        (libc::SYS_sched_setattr, &[(0, 0)]),
        (libc::SYS_sched_setaffinity, &[(0, 0)]),
        (libc::SYS_ioprio_set, &[(0, IOPRIO_WHO_PROCESS), (1, 0)]),
    ] {
        rules.insert(nr, unless(conds)?);
        if cfg!(target_arch = "x86_64") {
            rules.insert(nr | X32_SYSCALL_BIT, unless(conds)?);
        }
    }
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EACCES as u32),
        arch,
    )
    .map_err(err)?;
    filter.try_into().map_err(err)
}

/// The bit that marks a system call number of the x32 ABI on x86-64.
const X32_SYSCALL_BIT: i64 = 0x4000_0000;

/// `memfd_secret(2)` (Linux 5.14), numbered alike on every architecture.
const SYS_MEMFD_SECRET: i64 = 447;
/// `fchmodat2(2)` (Linux 6.6).
const SYS_FCHMODAT2: i64 = 452;
/// `setxattrat(2)` (Linux 6.13).
const SYS_SETXATTRAT: i64 = 463;
/// `removexattrat(2)` (Linux 6.13).
const SYS_REMOVEXATTRAT: i64 = 466;

/// Marks every descriptor from 3 up close-on-exec, so a task inherits
/// only its standard input, output and error, never a descriptor `agw`
/// itself inherited (from a service manager, a wrapper script, a
/// `--token-file /dev/fd/N`). Meant for the child between `fork` and
/// `exec`: system calls only, nothing allocated.
///
/// # Errors
///
/// The OS error of the call that failed (the task must then not start).
pub fn close_inherited_descriptors() -> io::Result<()> {
    // SAFETY: close_range(2) with integer arguments; it only sets flags.
    let r = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    if r == 0 {
        return Ok(());
    }
    // Kernels before 5.11: one descriptor at a time, up to the limit.
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == -1 {
        return Err(io::Error::last_os_error());
    }
    let top = i32::try_from(lim.rlim_cur.min(1 << 20)).unwrap_or(1 << 20);
    for fd in 3..top {
        // SAFETY: fcntl on a descriptor number; EBADF for a closed one.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        if flags >= 0
            && flags & libc::FD_CLOEXEC == 0
            // SAFETY: as above.
            && unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) } == -1
        {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Creates the scratch root (mode 0711 so the task identity can reach its
/// own directory in it, but cannot list the others), and checks that the
/// task identity can reach it through every directory above.
///
/// The root must be agw's own: a directory (not a link) owned by agw's
/// user, under directories owned by root or that user (the owner of a
/// directory can rename anything in it). A root that someone else made
/// (say, another user's `/tmp/agw-scratch-<id>` created before agw
/// started) is refused: its owner could swap a job's directory for a link
/// to a file agw would then hand to the task identity. Each job's
/// directory is set up through a descriptor opened without following
/// links ([`Sandbox::scratch`]), so a directory above that others may
/// write (a container's `/tmp` volume, mode 0777) cannot redirect that
/// either. Returns the root with the directories above resolved, the
/// path every later use takes.
fn create_scratch_root(config: &SandboxConfig) -> Result<PathBuf, SandboxError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let root = &config.scratch_root;
    if !root.is_absolute() {
        return Err(SandboxError::Config(format!(
            "--scratch-dir {} must be an absolute path",
            root.display()
        )));
    }
    let io_err = |what: String| move |source| SandboxError::Io { what, source };
    let parent = root.parent().ok_or_else(|| {
        SandboxError::Config(format!("--scratch-dir {} has no parent", root.display()))
    })?;
    std::fs::create_dir_all(parent)
        .map_err(io_err(format!("cannot create {}", parent.display())))?;
    // The directories above, as the kernel resolves them (links followed).
    let parent = std::fs::canonicalize(parent)
        .map_err(io_err(format!("cannot resolve {}", parent.display())))?;
    let root = parent.join(root.file_name().ok_or_else(|| {
        SandboxError::Config(format!("--scratch-dir {} has no name", root.display()))
    })?);
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    for dir in parent.ancestors() {
        let meta = std::fs::symlink_metadata(dir)
            .map_err(io_err(format!("cannot inspect {}", dir.display())))?;
        if meta.uid() != 0 && meta.uid() != me {
            return Err(SandboxError::Config(format!(
                "--scratch-dir {}: {} belongs to uid {}, who could replace what is in it; \
                 choose a directory under ones owned by root or agw's user (uid {me})",
                root.display(),
                dir.display(),
                meta.uid()
            )));
        }
    }
    match std::fs::DirBuilder::new().mode(0o711).create(&root) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(io_err(format!(
                "cannot create the scratch root {}",
                root.display()
            ))(e))
        }
    }
    let meta = std::fs::symlink_metadata(&root)
        .map_err(io_err(format!("cannot inspect {}", root.display())))?;
    if !meta.file_type().is_dir() || meta.uid() != me {
        return Err(SandboxError::Config(format!(
            "--scratch-dir {} is not a directory of agw's user (uid {me}): it is {} owned by \
             uid {}; remove it or choose another",
            root.display(),
            if meta.file_type().is_symlink() {
                "a symbolic link"
            } else if meta.file_type().is_dir() {
                "a directory"
            } else {
                "a file"
            },
            meta.uid()
        )));
    }
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o711))
        .map_err(io_err(format!("cannot set the mode of {}", root.display())))?;
    let Some(who) = config.run_as else {
        return Ok(root);
    };
    for dir in root.ancestors().skip(1) {
        let meta = std::fs::metadata(dir).map_err(|source| SandboxError::Io {
            what: format!("cannot inspect {}", dir.display()),
            source,
        })?;
        let mode = meta.mode();
        let reachable = mode & 0o001 != 0
            || (meta.uid() == who.uid && mode & 0o100 != 0)
            || (meta.gid() == who.gid && mode & 0o010 != 0);
        if !reachable {
            return Err(SandboxError::Config(format!(
                "--scratch-dir {}: tasks run as uid {} cannot reach it, {} has mode {:o}",
                root.display(),
                who.uid,
                dir.display(),
                mode & 0o7777
            )));
        }
    }
    Ok(root)
}

/// Splits `tools` into those the sandbox can start (with the executables to
/// allow) and the names of script tools whose interpreter is not a tool.
fn executables(tools: &ToolSet) -> (ToolSet, Vec<String>, Vec<PathBuf>) {
    let mut exec = Vec::new();
    let mut keep = Vec::new();
    let mut dropped = Vec::new();
    let tool_paths: Vec<PathBuf> = tools
        .names()
        .iter()
        .filter_map(|n| tools.path(n))
        .filter_map(|p| std::fs::canonicalize(p).ok())
        .collect();
    for name in tools.names() {
        let Some(path) = tools.path(name) else {
            continue;
        };
        let Ok(real) = std::fs::canonicalize(path) else {
            dropped.push(name.clone());
            continue;
        };
        match interpreter(&real) {
            Interp::Elf(loader) => {
                exec.push(real);
                if let Some(l) = loader.and_then(|l| std::fs::canonicalize(l).ok()) {
                    exec.push(l);
                }
                keep.push(name.clone());
            }
            Interp::Script(interp) => {
                let ok = std::fs::canonicalize(&interp)
                    .map(|i| tool_paths.contains(&i))
                    .unwrap_or(false);
                if ok {
                    exec.push(real);
                    keep.push(name.clone());
                } else {
                    dropped.push(name.clone());
                }
            }
            Interp::Unknown => dropped.push(name.clone()),
        }
    }
    exec.sort();
    exec.dedup();
    (tools.subset(&keep), dropped, exec)
}

/// The executables that several of `tools` resolve to, with those tools'
/// names: a multi-call binary (busybox, a single-binary coreutils) linked
/// under several names is one file, which the sandbox lets a task run
/// under any name, every program it contains included.
fn shared_executables(tools: &ToolSet) -> Vec<(PathBuf, Vec<String>)> {
    let mut by_file: std::collections::BTreeMap<PathBuf, Vec<String>> = Default::default();
    for name in tools.names() {
        if let Some(real) = tools.path(name).and_then(|p| std::fs::canonicalize(p).ok()) {
            by_file.entry(real).or_default().push(name.clone());
        }
    }
    by_file.into_iter().filter(|(_, n)| n.len() > 1).collect()
}

/// How the kernel starts an executable.
#[derive(Debug, PartialEq, Eq)]
enum Interp {
    /// An ELF file, with its dynamic loader when it has one.
    Elf(Option<PathBuf>),
    /// A `#!` script and its interpreter.
    Script(PathBuf),
    /// Neither (or unreadable).
    Unknown,
}

/// Reads how `path` is started: its ELF `PT_INTERP` or its `#!` line.
fn interpreter(path: &Path) -> Interp {
    use object::read::elf::{FileHeader, ProgramHeader};
    let Ok(data) = std::fs::read(path) else {
        return Interp::Unknown;
    };
    if let Some(rest) = data.strip_prefix(b"#!") {
        let line = rest.split(|&b| b == b'\n').next().unwrap_or_default();
        let line = String::from_utf8_lossy(line);
        return match line.split_whitespace().next() {
            Some(i) => Interp::Script(PathBuf::from(i)),
            None => Interp::Unknown,
        };
    }
    fn elf<H: FileHeader<Endian = object::Endianness>>(data: &[u8]) -> Option<Interp> {
        let hdr = H::parse(data).ok()?;
        let endian = hdr.endian().ok()?;
        let mut loader = None;
        for ph in hdr.program_headers(endian, data).ok()? {
            if let Ok(Some(i)) = ph.interpreter(endian, data) {
                let i = i.split(|&b| b == 0).next().unwrap_or_default();
                loader = Some(PathBuf::from(std::ffi::OsStr::from_bytes(i)));
            }
        }
        Some(Interp::Elf(loader))
    }
    elf::<object::elf::FileHeader64<object::Endianness>>(&data)
        .or_else(|| elf::<object::elf::FileHeader32<object::Endianness>>(&data))
        .unwrap_or(Interp::Unknown)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_loader_of_a_dynamic_tool() {
        let sort = ToolSet::from_env(["sort"]);
        let real = std::fs::canonicalize(sort.path("sort").unwrap()).unwrap();
        match interpreter(&real) {
            Interp::Elf(Some(loader)) => assert!(loader.exists(), "{loader:?}"),
            other => panic!("sort should be a dynamic ELF file, got {other:?}"),
        }
    }

    #[test]
    fn script_tools_need_their_interpreter_advertised() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("myscript");
        std::fs::write(&script, "#!/bin/sh\necho hi\n").unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path =
            std::env::join_paths([dir.path(), Path::new("/usr/bin"), Path::new("/bin")]).unwrap();
        let alone = ToolSet::resolve(["myscript", "cat"], Some(&path));
        let (kept, dropped, _) = executables(&alone);
        assert_eq!(kept.names(), ["cat".to_owned()]);
        assert_eq!(dropped, ["myscript".to_owned()]);
        let with_sh = ToolSet::resolve(["myscript", "sh"], Some(&path));
        let (kept, dropped, exec) = executables(&with_sh);
        assert_eq!(kept.names(), ["myscript".to_owned(), "sh".to_owned()]);
        assert!(dropped.is_empty());
        assert!(exec.contains(&std::fs::canonicalize(&script).unwrap()));
    }

    /// Tools linked to one file (a multi-call binary) are found; tools of
    /// their own files are not.
    #[test]
    fn tools_that_are_one_executable_are_found() {
        let dir = tempfile::tempdir().unwrap();
        let path =
            std::env::join_paths([dir.path(), Path::new("/usr/bin"), Path::new("/bin")]).unwrap();
        let sort = ToolSet::resolve(["sort"], Some(&path))
            .path("sort")
            .map(|p| std::fs::canonicalize(p).unwrap())
            .expect("sort on PATH");
        for name in ["applet-a", "applet-b"] {
            std::os::unix::fs::symlink(&sort, dir.path().join(name)).unwrap();
        }
        let tools = ToolSet::resolve(["applet-a", "applet-b", "cat"], Some(&path));
        assert_eq!(
            shared_executables(&tools),
            [(sort, vec!["applet-a".to_owned(), "applet-b".to_owned()])]
        );
        let apart = ToolSet::resolve(["cat", "applet-a"], Some(&path));
        assert!(shared_executables(&apart).is_empty());
    }

    #[test]
    fn a_scratch_root_the_task_user_cannot_reach_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let config = |root: PathBuf| SandboxConfig {
            enabled: false,
            read_paths: Vec::new(),
            allow_network: false,
            limits: ResourceLimits::default(),
            run_as: Some(RunAs {
                uid: 65534,
                gid: 65534,
            }),
            scratch_root: root,
        };
        let tools = ToolSet::from_env(["cat"]);
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let err = Sandbox::new(config(dir.path().join("scratch")), &tools).unwrap_err();
        assert!(err.to_string().contains("cannot reach"), "{err}");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(Sandbox::new(config(dir.path().join("scratch")), &tools).is_ok());
        assert!(Sandbox::new(config(PathBuf::from("relative/scratch")), &tools).is_err());
    }

    #[test]
    fn a_scratch_root_someone_else_controls_is_refused() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let root_user = nix::unistd::Uid::effective().is_root();
        let config = |root: PathBuf| SandboxConfig {
            enabled: false,
            read_paths: Vec::new(),
            allow_network: false,
            limits: ResourceLimits::default(),
            run_as: root_user.then_some(RunAs {
                uid: 65534,
                gid: 65534,
            }),
            scratch_root: root,
        };
        let tools = ToolSet::from_env(["cat"]);
        // A link in the root's place, even to a directory of agw's own.
        let own = dir.path().join("own");
        std::fs::create_dir(&own).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&own, &link).unwrap();
        let err = Sandbox::new(config(link), &tools).unwrap_err();
        assert!(err.to_string().contains("symbolic link"), "{err}");
        // A root agw made, left open to everyone: taken back (mode 0711).
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let (sandbox, _, _) = Sandbox::new(config(open.clone()), &tools).unwrap();
        assert_eq!(std::fs::metadata(&open).unwrap().mode() & 0o7777, 0o711);
        // A job's directory: 0700, the task identity's.
        let job = sandbox.scratch().unwrap();
        let meta = std::fs::symlink_metadata(job.path()).unwrap();
        assert!(meta.is_dir());
        assert_eq!(meta.mode() & 0o7777, 0o700);
        if root_user {
            assert_eq!((meta.uid(), meta.gid()), (65534, 65534));
            // A root another user made (the attack: another user's
            // /tmp/agw-scratch-<id> made before agw started).
            let theirs = dir.path().join("theirs");
            std::fs::create_dir(&theirs).unwrap();
            std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
            let err = Sandbox::new(config(theirs), &tools).unwrap_err();
            assert!(
                err.to_string().contains("not a directory of agw's user"),
                "{err}"
            );
            // Under a directory another user owns.
            let above = dir.path().join("above");
            std::fs::create_dir(&above).unwrap();
            std::fs::set_permissions(&above, std::fs::Permissions::from_mode(0o755)).unwrap();
            std::os::unix::fs::chown(&above, Some(65534), Some(65534)).unwrap();
            let err = Sandbox::new(config(above.join("scratch")), &tools).unwrap_err();
            assert!(err.to_string().contains("belongs to uid 65534"), "{err}");
        }
    }

    #[test]
    fn granting_access_in_a_scratch_tree_follows_no_link_out_of_it() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o500)).unwrap();
        let tree = dir.path().join("tree");
        std::fs::create_dir_all(tree.join("a/b")).unwrap();
        std::fs::write(tree.join("a/b/data"), "x").unwrap();
        std::os::unix::fs::symlink(&outside, tree.join("a/link")).unwrap();
        std::os::unix::fs::symlink(&outside, tree.join("link")).unwrap();
        std::fs::set_permissions(tree.join("a/b"), std::fs::Permissions::from_mode(0o0)).unwrap();
        std::fs::set_permissions(tree.join("a"), std::fs::Permissions::from_mode(0o100)).unwrap();
        grant_owner_access(&tree);
        let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().mode() & 0o7777;
        assert_eq!(mode(&tree.join("a")), 0o700);
        assert_eq!(mode(&tree.join("a/b")), 0o700);
        assert_eq!(mode(&outside), 0o500, "a link was followed");
        remove_tree(&tree).unwrap();
        assert!(!tree.exists());
        assert!(outside.is_dir());
        remove_tree(&tree).unwrap();
    }

    #[test]
    fn the_seccomp_filter_compiles() {
        assert!(!task_filter(false).unwrap().is_empty());
        assert!(!task_filter(true).unwrap().is_empty());
    }
}
