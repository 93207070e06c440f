//! Runs a Plan's tasks as real processes.
//!
//! Every task is a direct exec of its `command` (resolved through the
//! worker's [`ToolSet`], never a shell) in its own process group. Its stdin
//! is the full stdout of the task named by `input_from_task`, or empty
//! (`/dev/null`). A stdout a later task reads is written, as it comes, to
//! a temporary file (under `TMPDIR`, deleted once no later task needs it),
//! so a pipeline's data is bounded by the disk, not the worker's memory.
//! Stdout and stderr are captured up to a cap for the report; the rest is
//! read and dropped so the process never blocks on a full pipe, and the
//! truncation is flagged. A task that outlives its `timeout_secs`, or whose
//! job is aborted (cancel, lost lease, drain timeout), gets its whole process
//! group killed with `SIGKILL`, so children such as a `sleep` die too. A
//! task whose leader exits has what is left of its group (background
//! children) killed as well: a task leaves no processes behind.
//!
//! Before anything runs, every task of the plan is checked: its command must
//! be advertised, its `{{name}}` placeholders must have values, and its
//! `input_from_task` must name an earlier task. One bad task fails the job
//! and nothing executes.

use std::{
    collections::{HashMap, HashSet},
    fmt, io,
    os::unix::process::ExitStatusExt,
    path::PathBuf,
    process::Stdio,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use nix::{
    sys::{
        signal::{kill, killpg, Signal},
        wait::{waitpid, WaitPidFlag},
    },
    unistd::Pid,
};
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWriteExt},
    process::{Child, Command},
    sync::watch,
    task::JoinHandle,
};

use super::{
    sandbox::{self, Confinement, Sandbox},
    template,
    tools::ToolSet,
};
use crate::pb::{Plan, TaskResult};
use tracing::Instrument;

/// Default cap on the captured stdout and on the captured stderr of one task,
/// in bytes (1 MiB each).
pub const DEFAULT_OUTPUT_CAP_BYTES: usize = 1024 * 1024;

/// Longest stderr excerpt quoted in a job's error message, in bytes.
pub const ERROR_STDERR_QUOTE_BYTES: usize = 1000;

/// Timeout used for a task whose `timeout_secs` is 0 (unset): the largest
/// value a Plan may carry, one day, in seconds.
pub const UNSET_TIMEOUT_SECS: u32 = 86_400;

/// How long the pipes of a killed task may stay open (held by a process that
/// left the group) before capture stops anyway.
const PIPE_GRACE: Duration = Duration::from_secs(2);

/// `PATH` of a sandboxed task: the system's binary directories (only the
/// advertised tools can run anyway).
const TASK_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// How long to wait for a killed process to be reaped.
const REAP_GRACE: Duration = Duration::from_secs(5);

/// Why a running job was stopped from outside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AbortReason {
    /// The server cancelled the job (pushed `cancel_job_id`).
    Cancelled,
    /// The server no longer recognises our lease (an update was rejected);
    /// carries the server's message.
    LeaseLost(String),
    /// The worker was draining and the drain timeout ran out; carries the
    /// timeout.
    DrainTimeout(Duration),
    /// The worker is shutting down at once.
    Shutdown,
}

impl fmt::Display for AbortReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AbortReason::Cancelled => f.write_str("cancelled"),
            AbortReason::LeaseLost(msg) => write!(f, "lease lost: {msg}"),
            AbortReason::DrainTimeout(d) => {
                write!(f, "killed: drain timeout of {} s exceeded", d.as_secs())
            }
            AbortReason::Shutdown => f.write_str("killed: worker shut down"),
        }
    }
}

/// Sender side of a job's abort signal: set it to `Some(reason)` to stop the
/// job.
pub type AbortSender = watch::Sender<Option<AbortReason>>;

/// Receiver side of a job's abort signal, given to [`Executor::run`].
pub type AbortReceiver = watch::Receiver<Option<AbortReason>>;

/// A fresh abort signal pair, not yet triggered.
pub fn abort_channel() -> (AbortSender, AbortReceiver) {
    watch::channel(None)
}

/// Progress of a job: emitted when a task starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskStart {
    /// The task's `task_number` (1-based).
    pub task_number: u32,
    /// Share of the plan's tasks already finished, 0..=100.
    pub progress_percent: u32,
}

/// The result of running a plan on one input.
#[derive(Debug, Clone, PartialEq)]
pub struct JobOutcome {
    /// True when every task exited with code 0.
    pub success: bool,
    /// Why the job failed (empty on success). Names the task and command and
    /// quotes a bounded part of its stderr.
    pub error: String,
    /// One result per task that was started, in plan order.
    pub task_results: Vec<TaskResult>,
    /// Set when the job was stopped from outside.
    pub aborted: Option<AbortReason>,
    /// The failing task exited with one of its `permanent_exit_codes`:
    /// the failure is reported as permanent (not retried).
    pub permanent: bool,
    /// Wall-clock time of the whole job.
    pub duration: Duration,
}

impl JobOutcome {
    fn failed(error: String, task_results: Vec<TaskResult>, start: Instant) -> Self {
        JobOutcome {
            success: false,
            error,
            task_results,
            aborted: None,
            permanent: false,
            duration: start.elapsed(),
        }
    }
}

/// The process groups of every task running now, so that a worker exiting
/// at once can kill them all.
#[derive(Debug, Clone, Default)]
pub struct ProcessGroups(Arc<Mutex<Registry>>);

/// What [`ProcessGroups`] holds.
#[derive(Debug, Default)]
struct Registry {
    /// Groups of tasks not yet killed: their leader is not reaped, so each
    /// id still names that group and no other process's.
    live: HashSet<i32>,
    /// Groups of tasks not yet over (killed or not), with how many tasks
    /// hold each id: a task whose leader was reaped no longer owns its id,
    /// which a new task may have got; [`ProcessGroups::reap_escaped`]
    /// spares these.
    held: HashMap<i32, usize>,
}

impl ProcessGroups {
    /// Sends `SIGKILL` to every registered process group not yet killed.
    pub fn kill_all(&self) {
        for pgid in self.lock().live.iter() {
            kill_group(*pgid);
        }
    }

    /// Number of process groups running now.
    pub fn len(&self) -> usize {
        self.lock().held.len()
    }

    /// True when no task is running.
    pub fn is_empty(&self) -> bool {
        self.lock().held.is_empty()
    }

    /// Kills and reaps every process `agw` adopted that belongs to no
    /// running task, together with all of its descendants: a task's
    /// descendant that left its process group (`setsid`, `setpgid`) and
    /// outlived its parent is re-parented to `agw`, the subreaper
    /// ([`adopt_orphans`]), instead of to init, and ends here with the
    /// whole tree it started ([`kill_tree`]) instead of running on after
    /// its job. Returns how many processes it killed. `agw` calls it after
    /// every task and every [`REAP_EVERY`]. It does nothing in a process
    /// that is not a subreaper (a program running the executor in-process,
    /// whose other children are its own business).
    pub fn reap_escaped(&self) -> usize {
        if !is_subreaper() {
            return 0;
        }
        // Each child is judged, and stopped, under the lock: a task
        // leader is registered under it in the same hold as its fork, so
        // no new leader is taken for an escaped process. The lock is not
        // held while trees are stopped and walked (a process that does not
        // stop would hold every task's start and end with it).
        sweep_children(
            |pid, pgrp| {
                let running = self.lock();
                !running.held.contains_key(&pid)
                    && !running.held.contains_key(&pgrp)
                    && kill(Pid::from_raw(pid), Signal::SIGSTOP).is_ok()
            },
            Instant::now() + SWEEP_BUDGET,
        )
    }

    /// For a worker about to exit: kills every task's process group
    /// ([`Self::kill_all`]), then every process left among its children
    /// and their descendants (task leaders, and what escaped their groups
    /// and came to the subreaper, orphaned by those kills), until none is
    /// left or `within` has passed. Without it, what a task left outside
    /// its group would be re-parented to init when `agw` exits and run on.
    /// Returns how many processes the sweep killed; in a process that is
    /// not a subreaper it only kills the groups (and returns 0).
    pub async fn kill_everything(&self, within: Duration) -> usize {
        self.kill_all();
        if !is_subreaper() {
            return 0;
        }
        let deadline = tokio::time::Instant::now() + within;
        let mut killed = 0;
        loop {
            // It may wait for processes to stop: off the runtime's threads.
            let until = Instant::now() + SWEEP_BUDGET;
            killed += tokio::task::spawn_blocking(move || sweep_children(|_, _| true, until))
                .await
                .unwrap_or(0);
            // Done when only the killed are left, not yet reaped.
            let live = own_children()
                .into_iter()
                .any(|pid| proc_stat(pid).is_some_and(|s| s.state != 'Z'));
            if !live || tokio::time::Instant::now() >= deadline {
                return killed;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Spawns `cmd` (whose child makes itself a session and process group
    /// leader) and
    /// registers its group, so that no [`Self::reap_escaped`] runs between
    /// the two.
    fn spawn(&self, cmd: &mut Command) -> io::Result<(Child, GroupGuard)> {
        let mut running = self.lock();
        let child = cmd.spawn()?;
        let pgid = child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .unwrap_or(0);
        running.live.insert(pgid);
        *running.held.entry(pgid).or_default() += 1;
        drop(running);
        Ok((
            child,
            GroupGuard {
                pgid,
                groups: self.clone(),
                killed: false,
            },
        ))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        // A panic while holding this lock leaves a consistent set; keep going.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// How often `agw` looks for processes that escaped a task
/// ([`ProcessGroups::reap_escaped`]) besides after each task.
pub const REAP_EVERY: Duration = Duration::from_secs(2);

/// Makes this process the subreaper of its descendants
/// (`PR_SET_CHILD_SUBREAPER`): an orphan among them is re-parented to it,
/// not to init, where [`ProcessGroups::reap_escaped`] finds it.
///
/// # Errors
///
/// The OS error of `prctl`.
pub fn adopt_orphans() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// True when this process is a child subreaper ([`adopt_orphans`]).
fn is_subreaper() -> bool {
    let mut subreaper: libc::c_int = 0;
    // SAFETY: PR_GET_CHILD_SUBREAPER writes one int through the pointer.
    let asked = unsafe { libc::prctl(libc::PR_GET_CHILD_SUBREAPER, &mut subreaper) };
    asked == 0 && subreaper != 0
}

/// Upper bound on the rounds of one [`sweep_children`]: a round only
/// repeats when it killed something, and what a round misses (a child a
/// process forked while it was being stopped) is at most a straggler.
const SWEEP_ROUNDS: usize = 8;

/// Longest one [`sweep_children`] waits for processes to stop, in all: a
/// task that keeps leaving processes that do not stop at once (a `vfork`
/// parent waits in uninterruptible sleep) makes the sweep end early, and
/// the next one goes on.
const SWEEP_BUDGET: Duration = Duration::from_secs(1);

/// Kills, with their whole trees ([`kill_tree`]), the children of this
/// process that `select(pid, pgrp)` picks, and reaps them; repeats while a
/// round found one alive (a process re-parented to this one while the
/// round ran), at most [`SWEEP_ROUNDS`] times, and stops starting trees
/// at `until`. Zombies among the children are reaped. Returns how many
/// processes it killed.
fn sweep_children(mut select: impl FnMut(i32, i32) -> bool, until: Instant) -> usize {
    let me = std::process::id() as i32;
    let mut killed = 0;
    for _ in 0..SWEEP_ROUNDS {
        if Instant::now() >= until {
            break;
        }
        let mut this_round = 0;
        for pid in own_children() {
            let Some(stat) = proc_stat(pid) else {
                continue;
            };
            // Not a child any more, or not one to kill.
            if stat.ppid != me || !select(pid, stat.pgrp) {
                continue;
            }
            // A child not yet reaped keeps its pid: this is the process
            // listed (a zombie ignores signals and is reaped).
            if stat.state != 'Z' {
                this_round += kill_tree(pid, until);
            }
            let _ = waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG));
        }
        killed += this_round;
        if this_round == 0 {
            break;
        }
    }
    killed
}

/// How long [`kill_tree`] waits for one process to stop before listing its
/// children anyway, and for all of a tree's processes together (a process
/// that does not stop, stopped by a debugger say, holds the sweep at most
/// that long; never the start or end of a task).
const STOP_WAIT: Duration = Duration::from_millis(50);
const STOP_WAIT_TREE: Duration = Duration::from_millis(500);

/// Kills `root` and every descendant it has. Killing only `root` would
/// hand its children to the subreaper, to be killed a round later, while
/// a chain that forks at its far end grows faster than one link a round:
/// so the tree is first frozen top-down (`SIGSTOP`, and its children
/// listed once it stopped, when it can no longer fork: a stopped process
/// keeps its children, a dead one would have given them away), then every
/// frozen process gets `SIGKILL`. Returns how many processes it signalled.
/// `root` must be a child of this process not yet reaped, so that its pid
/// and those of its descendants (whose parents cannot reap them once
/// stopped) name the processes listed. It waits for no process past
/// `until`. A process in uninterruptible sleep (`D`) counts as stopped:
/// with `SIGSTOP` pending it stops before it runs its own code again.
fn kill_tree(root: i32, until: Instant) -> usize {
    let tree_deadline = until.min(Instant::now() + STOP_WAIT_TREE);
    let mut frozen = Vec::new();
    let mut seen = HashSet::new();
    let mut stack = vec![root];
    while let Some(pid) = stack.pop() {
        if !seen.insert(pid) {
            continue;
        }
        if kill(Pid::from_raw(pid), Signal::SIGSTOP).is_err() {
            continue;
        }
        frozen.push(pid);
        let until = tree_deadline.min(Instant::now() + STOP_WAIT);
        while proc_stat(pid).is_some_and(|s| !matches!(s.state, 'T' | 't' | 'Z' | 'X' | 'D'))
            && Instant::now() < until
        {
            std::thread::sleep(Duration::from_micros(200));
        }
        stack.extend(children_of(pid));
    }
    for pid in &frozen {
        let _ = kill(Pid::from_raw(*pid), Signal::SIGKILL);
    }
    frozen.len()
}

/// The pids of this process's children ([`children_of`]).
fn own_children() -> Vec<i32> {
    children_of(std::process::id() as i32)
}

/// The pids of the children of `parent`: from each of its threads'
/// `/proc/<pid>/task/<tid>/children`, or, on a kernel without those files,
/// every process whose parent it is.
fn children_of(parent: i32) -> Vec<i32> {
    let mut pids = Vec::new();
    let mut listed = false;
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{parent}/task")) {
        for t in tasks.flatten() {
            if let Ok(list) = std::fs::read_to_string(t.path().join("children")) {
                listed = true;
                pids.extend(
                    list.split_whitespace()
                        .filter_map(|p| p.parse::<i32>().ok()),
                );
            }
        }
    }
    if !listed {
        if let Ok(all) = std::fs::read_dir("/proc") {
            pids.extend(
                all.flatten()
                    .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
                    .filter(|&pid| proc_stat(pid).is_some_and(|s| s.ppid == parent)),
            );
        }
    }
    pids
}

/// What `/proc/<pid>/stat` says of a process.
#[derive(Debug, Clone, Copy)]
struct ProcStat {
    /// Its state letter (`R`, `S`, `T`, `Z`, …).
    state: char,
    /// Its parent's pid.
    ppid: i32,
    /// Its process group.
    pgrp: i32,
}

/// The state, parent pid and process group of `pid`, from
/// `/proc/<pid>/stat` (`pid (comm) state ppid pgrp ...`; `comm` may hold
/// spaces and parentheses, so the fields are read after its last `)`).
fn proc_stat(pid: i32) -> Option<ProcStat> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut fields = stat.get(stat.rfind(')')? + 1..)?.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgrp = fields.next()?.parse().ok()?;
    Some(ProcStat { state, ppid, pgrp })
}

/// Kills one task's process group once (on demand, or when dropped if not
/// yet), and keeps it registered in [`ProcessGroups`] until dropped.
///
/// The group is killed only while its leader is not reaped: until then the
/// id is the group's (a zombie leader keeps it), after that the kernel may
/// give it to any new process, whose group a late `killpg` would kill.
struct GroupGuard {
    pgid: i32,
    groups: ProcessGroups,
    killed: bool,
}

impl GroupGuard {
    /// Kills the group (once) and takes it off the groups [`ProcessGroups::kill_all`]
    /// kills. Call it before the leader is reaped.
    fn kill(&mut self) {
        if !self.killed {
            self.killed = true;
            let mut running = self.groups.lock();
            kill_group(self.pgid);
            running.live.remove(&self.pgid);
        }
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        // Dropped early (the job's future dropped): the leader is not
        // reaped yet, the group goes with it.
        self.kill();
        let mut running = self.groups.lock();
        if let Some(n) = running.held.get_mut(&self.pgid) {
            *n -= 1;
            if *n == 0 {
                running.held.remove(&self.pgid);
            }
        }
    }
}

/// A descriptor of process `pid` (`pidfd_open`), readable once it exited,
/// without reaping it; `None` where the kernel has none (before 5.3).
fn pidfd(pid: Option<u32>) -> Option<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>> {
    use std::os::fd::FromRawFd;
    let pid = libc::pid_t::try_from(pid?).ok()?;
    // SAFETY: pidfd_open(2) with integer arguments; it returns a new
    // descriptor (close-on-exec) or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let fd = i32::try_from(fd).ok().filter(|&fd| fd >= 0)?;
    // SAFETY: a descriptor just returned to us, owned by nobody else.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    // SAFETY: the AsyncFd owns the OwnedFd, which stays open and the same
    // descriptor until the AsyncFd is dropped.
    unsafe { tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
        .ok()
}

/// Whether the process of `pidfd` has exited (its descriptor is readable
/// now), without waiting and without reaping it.
fn exited(pidfd: &std::os::fd::OwnedFd) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll(2) on one pollfd that lives across the call, timeout 0.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n == 1 && p.revents & libc::POLLIN != 0
}

/// Waits until the task's leader exits. With its `pidfd` it is not reaped
/// (`None`: [`Child::wait`] then collects its status at once); without,
/// its status as [`Child::wait`] reaped it.
async fn leader_exit(
    child: &mut Child,
    pidfd: Option<&tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>>,
) -> Option<io::Result<std::process::ExitStatus>> {
    if let Some(fd) = pidfd {
        if fd.readable().await.is_ok() {
            return None;
        }
    }
    Some(child.wait().await)
}

/// `SIGKILL` to a process group; a group that is already gone is fine.
fn kill_group(pgid: i32) {
    if pgid > 1 {
        let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
    }
}

/// A task checked and ready to run.
#[derive(Debug)]
struct Prepared {
    task_number: u32,
    command: String,
    path: PathBuf,
    args: Vec<String>,
    timeout: Duration,
    input_from: Option<u32>,
    permanent_exit_codes: Vec<i32>,
}

/// Runs plans with a fixed tool set and output cap.
#[derive(Debug, Clone)]
pub struct Executor {
    tools: Arc<ToolSet>,
    output_cap: usize,
    groups: ProcessGroups,
    /// Environment variables tasks do not inherit (the worker's own
    /// `AGW_*` settings, among them its token).
    hidden_env: Arc<Vec<std::ffi::OsString>>,
    /// Directory of the files holding stdouts that later tasks read;
    /// `None`: the system's temporary directory (`TMPDIR`).
    spill_dir: Option<PathBuf>,
    /// The task sandbox: scratch directory, minimal environment, identity,
    /// limits, Landlock and seccomp. `None` (tests of the executor alone):
    /// tasks inherit the worker's environment (less `AGW_*`) and directory.
    sandbox: Option<Arc<Sandbox>>,
}

/// What a task of a sandboxed job runs with.
struct TaskJail<'a> {
    /// The job's scratch directory: working directory, `HOME`, `TMPDIR`.
    scratch: &'a std::path::Path,
    /// What the child applies before `exec`.
    confinement: Confinement,
    /// The sandbox it comes from.
    sandbox: &'a Sandbox,
}

/// Names of this process's environment variables that start with `AGW_`.
fn agw_env_names() -> Vec<std::ffi::OsString> {
    std::env::vars_os()
        .map(|(k, _)| k)
        .filter(|k| k.as_encoded_bytes().starts_with(b"AGW_"))
        .collect()
}

/// How one task ended.
#[derive(Debug)]
enum TaskEnd {
    Exited(i32),
    Signalled(i32),
    TimedOut(Duration),
    Aborted(AbortReason),
    SpawnFailed(io::Error),
    /// It exited 0, but its stdout, which a later task reads, could not be
    /// written whole to its spill file (disk full, ...).
    OutputLost(io::Error),
}

/// Output of one stream, as read.
#[derive(Debug, Default)]
struct Captured {
    /// The first `cap` bytes.
    data: Vec<u8>,
    /// Bytes the stream produced in all.
    total: u64,
    /// Writing the full output to its spill file failed.
    spill_error: Option<io::Error>,
    /// Reading stopped while the stream was still open (a process that
    /// left the task's group held it past the grace): more may have come.
    cut: bool,
    /// Reading stopped because the output went over its spill's limit
    /// (`spill_error` says so).
    over_limit: bool,
}

/// One finished task.
struct TaskRun {
    result: TaskResult,
    end: TaskEnd,
    /// The file holding its full stdout, when a later task reads it.
    full_stdout: Option<tempfile::NamedTempFile>,
}

impl Executor {
    /// An executor that runs only the commands of `tools` and captures at
    /// most `output_cap` bytes of stdout and of stderr per task. Tasks
    /// inherit the worker's environment except its `AGW_*` variables (the
    /// token must not leak into task output).
    pub fn new(tools: Arc<ToolSet>, output_cap: usize) -> Self {
        Executor {
            tools,
            output_cap,
            groups: ProcessGroups::default(),
            hidden_env: Arc::new(agw_env_names()),
            spill_dir: None,
            sandbox: None,
        }
    }

    /// The same executor, running every job in its own scratch directory
    /// under `sandbox`: a minimal environment (`PATH`, `HOME` and `TMPDIR`
    /// set to the scratch directory, `LANG`), the sandbox's identity and
    /// limits, and (when enabled) Landlock and seccomp.
    pub fn with_sandbox(mut self, sandbox: Arc<Sandbox>) -> Self {
        self.sandbox = Some(sandbox);
        self
    }

    /// The same executor, keeping the stdouts that later tasks read in
    /// files under `dir` instead of the system's temporary directory.
    pub fn with_spill_dir(mut self, dir: PathBuf) -> Self {
        self.spill_dir = Some(dir);
        self
    }

    /// The advertised tools.
    pub fn tools(&self) -> &ToolSet {
        &self.tools
    }

    /// The process groups of the tasks running now (shared by clones).
    pub fn process_groups(&self) -> &ProcessGroups {
        &self.groups
    }

    /// Checks every task of `plan` before anything runs: advertised command,
    /// template variables present, `input_from_task` naming an earlier task.
    fn prepare(
        &self,
        plan: &Plan,
        input: &HashMap<String, String>,
    ) -> Result<Vec<Prepared>, String> {
        if plan.tasks.is_empty() {
            return Err("plan has no tasks".to_owned());
        }
        let mut tasks: Vec<_> = plan.tasks.iter().collect();
        tasks.sort_by_key(|t| t.task_number);
        // Unadvertised commands first: they are the most important refusal.
        for t in &tasks {
            if !self.tools.contains(&t.command) {
                return Err(format!(
                    "command {:?} is not advertised by this worker (task {})",
                    t.command, t.task_number
                ));
            }
        }
        let mut seen = HashSet::new();
        let mut prepared = Vec::with_capacity(tasks.len());
        for t in tasks {
            if !seen.insert(t.task_number) {
                return Err(format!("plan has task {} twice", t.task_number));
            }
            if let Some(from) = t.input_from_task {
                if from >= t.task_number || !seen.contains(&from) {
                    return Err(format!(
                        "task {} ({}): input_from_task {from} is not an earlier task",
                        t.task_number, t.command
                    ));
                }
            }
            let args = template::render_args(&t.args, input, t.allow_option_values)
                .map_err(|e| format!("task {} ({}): {e}", t.task_number, t.command))?;
            let path = self
                .tools
                .path(&t.command)
                .map(PathBuf::from)
                .ok_or_else(|| format!("command {:?} is not advertised", t.command))?;
            let secs = if t.timeout_secs == 0 {
                UNSET_TIMEOUT_SECS
            } else {
                t.timeout_secs
            };
            prepared.push(Prepared {
                task_number: t.task_number,
                command: t.command.clone(),
                path,
                args,
                timeout: Duration::from_secs(u64::from(secs)),
                input_from: t.input_from_task,
                permanent_exit_codes: t.permanent_exit_codes.clone(),
            });
        }
        Ok(prepared)
    }

    /// Runs `plan` on `input`: the tasks in `task_number` order, stopping at
    /// the first that fails. Calls `on_task_start` as each task starts.
    /// Setting `abort` kills the running task's process group and ends the
    /// job with the reason as its error.
    ///
    /// Never returns an error: every failure (refused command, missing
    /// template variable, spawn error, non-zero exit, timeout, abort) is a
    /// failed [`JobOutcome`] whose `error` says why.
    pub async fn run<F>(
        &self,
        plan: &Plan,
        input: &HashMap<String, String>,
        abort: AbortReceiver,
        on_task_start: F,
    ) -> JobOutcome
    where
        F: FnMut(TaskStart) + Send,
    {
        let start = Instant::now();
        let tasks = match self.prepare(plan, input) {
            Ok(t) => t,
            Err(e) => return JobOutcome::failed(e, Vec::new(), start),
        };
        // Which task's stdout feeds a later task, and the last task that needs it.
        let mut last_use: HashMap<u32, usize> = HashMap::new();
        for (i, t) in tasks.iter().enumerate() {
            if let Some(from) = t.input_from {
                last_use.insert(from, i);
            }
        }
        // The job's scratch directory, removed when the job ends, on a
        // blocking thread: its tasks may have left any number of files.
        let scratch = match &self.sandbox {
            Some(sb) => match sb.scratch() {
                Ok(dir) => Some(dir),
                Err(e) => {
                    return JobOutcome::failed(
                        format!("cannot create the job's scratch directory: {e}"),
                        Vec::new(),
                        start,
                    )
                }
            },
            None => None,
        };
        let out = self
            .run_tasks(
                &tasks,
                &last_use,
                scratch.as_ref(),
                abort,
                on_task_start,
                start,
            )
            .await;
        if let Some(dir) = scratch {
            let _ = tokio::task::spawn_blocking(move || drop(dir)).await;
        }
        out
    }

    /// The tasks of [`Executor::run`], in its job's scratch directory
    /// (with a sandbox): each runs in turn until one fails or `abort`
    /// says stop.
    async fn run_tasks<F>(
        &self,
        tasks: &[Prepared],
        last_use: &HashMap<u32, usize>,
        scratch: Option<&super::sandbox::ScratchDir>,
        mut abort: AbortReceiver,
        mut on_task_start: F,
        start: Instant,
    ) -> JobOutcome
    where
        F: FnMut(TaskStart) + Send,
    {
        // The job's confinement, built once; each task gets a clone.
        let confinement = match (&self.sandbox, scratch) {
            (Some(sb), Some(dir)) => match sb.confinement(dir.path()) {
                Ok(c) => Some((sb, dir.path(), c)),
                Err(e) => {
                    return JobOutcome::failed(
                        format!("cannot build the job's sandbox: {e}"),
                        Vec::new(),
                        start,
                    )
                }
            },
            _ => None,
        };
        let mut outputs: HashMap<u32, Arc<tempfile::NamedTempFile>> = HashMap::new();
        let mut results = Vec::with_capacity(tasks.len());
        let total = tasks.len();
        for (i, task) in tasks.iter().enumerate() {
            if let Some(reason) = abort.borrow().clone() {
                let mut out = JobOutcome::failed(reason.to_string(), results, start);
                out.aborted = Some(reason);
                return out;
            }
            on_task_start(TaskStart {
                task_number: task.task_number,
                progress_percent: u32::try_from(i * 100 / total).unwrap_or(100),
            });
            let stdin = task.input_from.and_then(|from| outputs.get(&from).cloned());
            let keep_full = last_use.contains_key(&task.task_number);
            let jail = match &confinement {
                Some((sb, dir, job)) => match job.try_clone() {
                    Ok(confinement) => Some(TaskJail {
                        scratch: dir,
                        confinement,
                        sandbox: sb,
                    }),
                    Err(e) => {
                        return JobOutcome::failed(
                            format!(
                                "task {} ({}): cannot build its sandbox: {e}",
                                task.task_number, task.command
                            ),
                            results,
                            start,
                        )
                    }
                },
                None => None,
            };
            // One span per task, a child of the caller's (the job's) span.
            let span = tracing::info_span!(
                "task",
                task_number = task.task_number,
                command = %task.command,
                args = task.args.len(),
                exit_code = tracing::field::Empty,
                duration_ms = tracing::field::Empty,
                end = tracing::field::Empty,
                otel.status_code = tracing::field::Empty,
            );
            let run = self
                .run_task(task, stdin, keep_full, jail, &mut abort)
                .instrument(span.clone())
                .await;
            span.record("exit_code", run.result.exit_code);
            span.record("duration_ms", run.result.duration_ms);
            span.record("end", tracing::field::debug(&run.end));
            if !matches!(run.end, TaskEnd::Exited(0)) {
                span.record("otel.status_code", "ERROR");
            }
            drop(span);
            // Free outputs no later task needs.
            outputs.retain(|from, _| last_use.get(from).is_some_and(|&last| last > i));
            let permanent = matches!(&run.end,
                TaskEnd::Exited(code) if *code != 0 && task.permanent_exit_codes.contains(code));
            let error = match &run.end {
                TaskEnd::Exited(0) => None,
                TaskEnd::Exited(code) => Some(with_stderr(
                    format!(
                        "task {} ({}) exited with code {code}{}",
                        task.task_number,
                        task.command,
                        if permanent {
                            " (one of its permanent_exit_codes)"
                        } else {
                            ""
                        }
                    ),
                    &run.result.stderr,
                )),
                TaskEnd::Signalled(sig) => Some(with_stderr(
                    format!(
                        "task {} ({}) was killed by signal {}",
                        task.task_number,
                        task.command,
                        signal_name(*sig)
                    ),
                    &run.result.stderr,
                )),
                TaskEnd::TimedOut(d) => Some(format!(
                    "task {} ({}) timed out after {} s",
                    task.task_number,
                    task.command,
                    d.as_secs()
                )),
                TaskEnd::Aborted(reason) => Some(reason.to_string()),
                TaskEnd::SpawnFailed(e) => Some(format!(
                    "task {} ({}) could not be started: {e}",
                    task.task_number, task.command
                )),
                TaskEnd::OutputLost(e) => Some(format!(
                    "task {} ({}): its stdout could not be kept for a later task: {e}",
                    task.task_number, task.command
                )),
            };
            let aborted = match &run.end {
                TaskEnd::Aborted(r) => Some(r.clone()),
                _ => None,
            };
            results.push(run.result);
            // The report can carry no more: what it would drop is dropped
            // now, so a job of many tasks holds at most that much output
            // (and one task's) however many ran. Cutting as the tasks end
            // comes to what one cut at the end would keep.
            fit_to_budget(&mut results, super::agent::REPORT_BUDGET_BYTES);
            if let Some(error) = error {
                let mut out = JobOutcome::failed(error, results, start);
                out.aborted = aborted;
                out.permanent = permanent;
                return out;
            }
            if let Some(full) = run.full_stdout {
                outputs.insert(task.task_number, Arc::new(full));
            }
        }
        JobOutcome {
            success: true,
            error: String::new(),
            task_results: results,
            aborted: None,
            permanent: false,
            duration: start.elapsed(),
        }
    }

    /// Runs one task to its end (exit, timeout, abort) and collects its
    /// result.
    async fn run_task(
        &self,
        task: &Prepared,
        stdin: Option<Arc<tempfile::NamedTempFile>>,
        keep_full: bool,
        jail: Option<TaskJail<'_>>,
        abort: &mut AbortReceiver,
    ) -> TaskRun {
        let mut result = TaskResult {
            task_number: task.task_number,
            command: task.command.clone(),
            exit_code: -1,
            ..Default::default()
        };
        // Stdin: the earlier task's output file, opened anew (its own
        // offset); the spill file for this task's stdout when a later task
        // reads it.
        let files = (|| -> io::Result<_> {
            let stdin = match &stdin {
                Some(f) => Stdio::from(read_only(f)?),
                None => Stdio::null(),
            };
            let spill = match (keep_full, &self.spill_dir) {
                (false, _) => None,
                (true, Some(dir)) => Some(tempfile::NamedTempFile::new_in(dir)?),
                (true, None) => Some(tempfile::NamedTempFile::new()?),
            };
            Ok((stdin, spill))
        })();
        let (stdin, spill) = match files {
            Ok(f) => f,
            Err(e) => {
                return TaskRun {
                    result,
                    end: TaskEnd::SpawnFailed(io::Error::new(
                        e.kind(),
                        format!("cannot open its input or output file: {e}"),
                    )),
                    full_stdout: None,
                };
            }
        };
        let mut cmd = Command::new(&task.path);
        cmd.arg0(&task.command)
            .args(&task.args)
            .stdin(stdin)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut confinement = None;
        match jail {
            Some(jail) => {
                let cfg = jail.sandbox.config();
                cmd.env_clear()
                    .env("PATH", TASK_PATH)
                    .env("HOME", jail.scratch)
                    .env("TMPDIR", jail.scratch)
                    .env(
                        "LANG",
                        std::env::var_os("LANG").unwrap_or_else(|| "C.UTF-8".into()),
                    )
                    .current_dir(jail.scratch);
                if let Some(r) = cfg.run_as {
                    cmd.uid(r.uid).gid(r.gid);
                }
                confinement = Some(jail.confinement);
            }
            None => {
                for name in self.hidden_env.iter() {
                    cmd.env_remove(name);
                }
            }
        }
        // SAFETY: the closure runs in the child between fork and exec. It
        // only issues system calls (setsid, prctl, close_range, setrlimit,
        // landlock, seccomp) on data built before the fork; it allocates
        // nothing and touches no lock. Descriptors agw inherited stay out
        // of the task. setsid makes the task the leader of a process group
        // in a session of its own, so none of its processes can join
        // another task's group (setpgid works within a session only).
        // PR_SET_PDEATHSIG asks the kernel to SIGKILL the child when the
        // thread that spawned it (an agw runtime thread) goes away, so a
        // `kill -9` of agw does not leave task leaders running; it is set
        // after the identity switch, which would clear it.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setsid() == -1 {
                    return Err(io::Error::last_os_error());
                }
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                    return Err(io::Error::last_os_error());
                }
                sandbox::close_inherited_descriptors()?;
                if let Some(c) = confinement.as_mut() {
                    c.apply()?;
                }
                Ok(())
            });
        }
        let started = Instant::now();
        let (mut child, mut group) = match self.groups.spawn(&mut cmd) {
            Ok(c) => c,
            Err(e) => {
                return TaskRun {
                    result,
                    end: TaskEnd::SpawnFailed(e),
                    full_stdout: None,
                };
            }
        };

        let (stop_tx, stop_rx) = watch::channel(false);
        let cap = self.output_cap;
        let spill_to = match spill.as_ref().map(|f| f.reopen()) {
            Some(Ok(f)) => Some(Ok(tokio::fs::File::from_std(f))),
            Some(Err(e)) => Some(Err(e)),
            None => None,
        };
        // A later task's input is a file like any the task writes: it is
        // held to the sandbox's file size limit too.
        let spill_limit = self
            .sandbox
            .as_ref()
            .map_or(0, |s| s.config().limits.file_size_bytes);
        let spill_to = spill_to.map(|f| Spill {
            file: f,
            limit: spill_limit,
        });
        let mut out_task = spawn_reader(child.stdout.take(), cap, spill_to, stop_rx.clone());
        let mut err_task = spawn_reader(child.stderr.take(), cap, None, stop_rx);

        let deadline = tokio::time::Instant::from_std(started + task.timeout);
        let exit = pidfd(child.id());
        // A leader found gone at the deadline (agw was stopped or starved
        // past it, and the runtime saw the time before the exit) ended on
        // its own before the timeout could be enforced: it counts as an
        // exit.
        let end = tokio::select! {
            biased;
            reason = aborted(abort) => Err(TaskEnd::Aborted(reason)),
            status = leader_exit(&mut child, exit.as_ref()) => Ok(status),
            () = tokio::time::sleep_until(deadline) => match exit.as_ref() {
                Some(fd) if exited(fd.get_ref()) => Ok(None),
                _ => Err(TaskEnd::TimedOut(task.timeout)),
            },
        };
        // The task is over: kill its group, whether it timed out, was
        // aborted, or its leader exited and left background children behind,
        // before the leader is reaped (the group's id is its own until
        // then). Output already in the pipes stays readable.
        group.kill();
        let end = match end {
            Err(end) => {
                let _ = tokio::time::timeout(REAP_GRACE, child.wait()).await;
                end
            }
            Ok(status) => {
                let status = match status {
                    Some(status) => status,
                    None => child.wait().await,
                };
                match status {
                    Ok(st) => match (st.code(), st.signal()) {
                        (Some(code), _) => TaskEnd::Exited(code),
                        (None, Some(sig)) => TaskEnd::Signalled(sig),
                        (None, None) => TaskEnd::Exited(-1),
                    },
                    Err(e) => TaskEnd::SpawnFailed(e),
                }
            }
        };
        // The pipes close once the group is dead; a process that left the
        // group may hold them open: stop reading after a grace.
        let grace = tokio::time::sleep(PIPE_GRACE);
        tokio::pin!(grace);
        let (mut out, mut err, mut stopped) = (None, None, false);
        while out.is_none() || err.is_none() {
            tokio::select! {
                r = &mut out_task, if out.is_none() => out = Some(r.unwrap_or_default()),
                r = &mut err_task, if err.is_none() => err = Some(r.unwrap_or_default()),
                () = &mut grace, if !stopped => {
                    stopped = true;
                    let _ = stop_tx.send(true);
                }
            }
        }
        drop(group);
        // What left the group and lost its parent with it is agw's now
        // (the sweep may wait for processes to stop: off the runtime's
        // threads).
        let groups = self.groups.clone();
        let _ = tokio::task::spawn_blocking(move || groups.reap_escaped()).await;
        result.duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        // Anything but a normal exit (signal, timeout, abort) reports -1.
        result.exit_code = match end {
            TaskEnd::Exited(code) => code,
            _ => -1,
        };
        let out = out.unwrap_or_default();
        let err = err.unwrap_or_default();
        let (stdout, stdout_truncated) = capped_text(&out, cap);
        let (stderr, stderr_truncated) = capped_text(&err, cap);
        // Output cut at the grace may be incomplete: flagged as cut.
        let (stdout_truncated, stderr_truncated) =
            (stdout_truncated || out.cut, stderr_truncated || err.cut);
        result.stdout = stdout;
        result.stdout_truncated = stdout_truncated;
        result.stderr = stderr;
        result.stderr_truncated = stderr_truncated;
        // A task whose output a later task needs, but that could not be
        // kept whole, fails.
        // Output over the limit fails it whatever its end (its reader
        // stopped, so it may have died of SIGPIPE).
        let end = match (end, out.spill_error) {
            (_, Some(e)) if out.over_limit => TaskEnd::OutputLost(e),
            (TaskEnd::Exited(0), Some(e)) => TaskEnd::OutputLost(e),
            (end, _) => end,
        };
        TaskRun {
            result,
            end,
            full_stdout: spill,
        }
    }
}

/// Waits until `abort` carries a reason; never resolves when its sender is
/// gone without one.
/// A read-only descriptor of the file behind `f` (through
/// `/proc/self/fd`, so it is that file whatever its path now names): a
/// task's standard input, which it must not be able to write.
///
/// # Errors
///
/// The OS error of the open.
fn read_only(f: &tempfile::NamedTempFile) -> io::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    std::fs::File::open(format!("/proc/self/fd/{}", f.as_file().as_raw_fd()))
}

async fn aborted(abort: &mut AbortReceiver) -> AbortReason {
    let reason = match abort.wait_for(Option::is_some).await {
        Ok(r) => r.clone(),
        Err(_) => None,
    };
    match reason {
        Some(r) => r,
        None => std::future::pending().await,
    }
}

/// Where a reader writes the full output: the opened spill file, or the
/// error opening it.
type SpillTo = Option<Spill>;

/// The file a task's full stdout goes to, for a later task to read.
struct Spill {
    /// The opened file, or the error opening it.
    file: io::Result<tokio::fs::File>,
    /// Most bytes it may hold (the sandbox's file size limit); 0: no limit.
    limit: u64,
}

/// Reads `pipe` to its end (or until `stop` turns true) on its own task.
fn spawn_reader<R>(
    pipe: Option<R>,
    cap: usize,
    spill: SpillTo,
    stop: watch::Receiver<bool>,
) -> JoinHandle<Captured>
where
    R: AsyncRead + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        match pipe {
            Some(p) => read_capped(p, cap, spill, stop).await,
            None => Captured::default(),
        }
    })
}

/// Reads everything from `r`, keeping the first `cap` bytes and, with a
/// `spill` file, writing every byte to it (the first write error is kept
/// and the rest still read, so the task never blocks). Output beyond the
/// spill's limit ends the reading (the task's next write gets `EPIPE` or
/// `SIGPIPE`), with the error kept as [`Captured::over_limit`]. Read errors
/// end the stream.
async fn read_capped<R: AsyncRead + Unpin>(
    mut r: R,
    cap: usize,
    spill: SpillTo,
    mut stop: watch::Receiver<bool>,
) -> Captured {
    let mut c = Captured::default();
    let limit = spill.as_ref().map_or(0, |s| s.limit);
    let mut file = match spill.map(|s| s.file) {
        Some(Ok(f)) => Some(f),
        Some(Err(e)) => {
            c.spill_error = Some(e);
            None
        }
        None => None,
    };
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = tokio::select! {
            n = r.read(&mut buf) => match n {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            },
            _ = stop.wait_for(|s| *s) => {
                c.cut = true;
                break;
            }
        };
        c.total += n as u64;
        let keep = n.min(cap.saturating_sub(c.data.len()));
        c.data.extend_from_slice(&buf[..keep]);
        if file.is_some() && limit > 0 && c.total > limit {
            c.spill_error = Some(io::Error::other(format!(
                "it wrote more than the file size limit of {} MiB (--max-file-size-mb) \
                 for a later task to read",
                limit.div_ceil(1 << 20)
            )));
            c.over_limit = true;
            break;
        }
        if let Some(f) = file.as_mut() {
            if let Err(e) = f.write_all(&buf[..n]).await {
                c.spill_error = Some(e);
                file = None;
            }
        }
    }
    if let Some(mut f) = file {
        if let Err(e) = f.flush().await {
            c.spill_error = Some(e);
        }
    }
    c
}

/// The captured text reported to the server: `c` lossily decoded (each
/// byte that is not UTF-8 becomes U+FFFD, three bytes) and cut to at most
/// `cap` bytes on a character boundary; and whether anything was dropped.
fn capped_text(c: &Captured, cap: usize) -> (String, bool) {
    let mut end = c.data.len().min(cap);
    if c.total > end as u64 {
        end = utf8_floor(&c.data[..end]);
    }
    let text = String::from_utf8_lossy(&c.data[..end]);
    let (kept, cut) = truncate_str(&text, cap);
    (kept.to_owned(), cut || c.total > end as u64)
}

/// Length of `data` without a trailing, incomplete UTF-8 sequence (one cut
/// by the capture cap).
fn utf8_floor(data: &[u8]) -> usize {
    let end = data.len();
    // The last byte that is not a continuation byte, within a char's reach.
    let Some(lead) = (end.saturating_sub(4)..end)
        .rev()
        .find(|&i| data[i] & 0xC0 != 0x80)
    else {
        return end;
    };
    let want = match data[lead] {
        b if b & 0x80 == 0 => 1,
        b if b & 0xE0 == 0xC0 => 2,
        b if b & 0xF0 == 0xE0 => 3,
        b if b & 0xF8 == 0xF0 => 4,
        _ => 1,
    };
    if lead + want > end {
        lead
    } else {
        end
    }
}

/// `text` cut to at most `max` bytes on a char boundary, and whether it was
/// cut.
fn truncate_str(text: &str, max: usize) -> (&str, bool) {
    if text.len() <= max {
        return (text, false);
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    (&text[..end], true)
}

/// `msg`, followed by `: <stderr>` (trimmed, bounded) when stderr is not
/// blank.
fn with_stderr(msg: String, stderr: &str) -> String {
    let trimmed = stderr.trim();
    if trimmed.is_empty() {
        return msg;
    }
    let (quote, cut) = truncate_str(trimmed, ERROR_STDERR_QUOTE_BYTES);
    if cut {
        format!("{msg}: {quote}…")
    } else {
        format!("{msg}: {quote}")
    }
}

/// `SIGSEGV` for 11, or the number when it is not a known signal.
fn signal_name(sig: i32) -> String {
    Signal::try_from(sig)
        .map(|s| s.as_str().to_owned())
        .unwrap_or_else(|_| sig.to_string())
}

/// Shrinks the captured outputs of `results` so that together they take at
/// most `budget` bytes, keeping as much of each as a fair share allows (the
/// small ones whole): the largest captures are cut first, their
/// `*_truncated` flags set. Keeps a final report under the server's message
/// size limit however many tasks ran.
pub fn fit_to_budget(results: &mut [TaskResult], budget: usize) {
    let mut sizes: Vec<usize> = results
        .iter()
        .flat_map(|r| [r.stdout.len(), r.stderr.len()])
        .collect();
    let total: usize = sizes.iter().sum();
    if total <= budget {
        return;
    }
    // Water-filling: the largest per-stream limit whose sum fits the budget.
    sizes.sort_unstable();
    let mut remaining = budget;
    let mut limit = 0;
    for (i, &s) in sizes.iter().enumerate() {
        let left = sizes.len() - i;
        let share = remaining / left;
        if s <= share {
            remaining -= s;
        } else {
            limit = share;
            break;
        }
    }
    for r in results.iter_mut() {
        if r.stdout.len() > limit {
            let (cut, _) = truncate_str(&r.stdout, limit);
            r.stdout = cut.to_owned();
            r.stdout_truncated = true;
        }
        if r.stderr.len() > limit {
            let (cut, _) = truncate_str(&r.stderr, limit);
            r.stderr = cut.to_owned();
            r.stderr_truncated = true;
        }
    }
}

#[cfg(test)]
mod tests;
