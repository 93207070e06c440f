//! The load and health figures every heartbeat carries, read from the host
//! with `sysinfo` and from the worker's own counters.

use std::{
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use sysinfo::{CpuRefreshKind, MemoryRefreshKind, RefreshKind, System};

use crate::pb::WorkerStats;

/// The worker's job counters, shared by every job task.
#[derive(Debug, Default)]
pub struct JobCounters {
    completed: AtomicU64,
    failed: AtomicU64,
    finished: AtomicU64,
    total_duration_ms: AtomicU64,
}

impl JobCounters {
    /// Counts one finished job: `success` tells completed from failed;
    /// `duration` goes into the average job duration.
    pub fn record(&self, success: bool, duration: Duration) {
        if success {
            self.completed.fetch_add(1, Ordering::Relaxed);
        } else {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        self.finished.fetch_add(1, Ordering::Relaxed);
        let ms = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
        self.total_duration_ms.fetch_add(ms, Ordering::Relaxed);
    }

    /// Jobs completed so far.
    pub fn completed(&self) -> u64 {
        self.completed.load(Ordering::Relaxed)
    }

    /// Jobs failed so far.
    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }

    /// Mean duration of the finished jobs in milliseconds (0 before the first).
    pub fn avg_duration_ms(&self) -> u64 {
        let n = self.finished.load(Ordering::Relaxed);
        self.total_duration_ms
            .load(Ordering::Relaxed)
            .checked_div(n)
            .unwrap_or(0)
    }
}

/// Host figures (CPU, memory, free disk) plus the job counters, collected on
/// demand.
#[derive(Debug, Clone)]
pub struct StatsCollector {
    started: Instant,
    counters: Arc<JobCounters>,
    system: Arc<Mutex<System>>,
    disk_path: PathBuf,
    /// The last host figures read: (CPU %, memory MB, free disk GB).
    last: Arc<Mutex<(f64, u64, u64)>>,
    /// True while a reading runs on a blocking thread.
    reading: Arc<AtomicBool>,
}

/// How long a heartbeat waits for the host figures before it goes with
/// the last ones: a file system that stops answering (a hung network
/// mount) must never hold up the heartbeat.
pub const HOST_READ_WAIT: Duration = Duration::from_secs(2);

impl StatsCollector {
    /// A collector for a worker started now, whose free disk space is
    /// measured on the filesystem holding `disk_path` (the working
    /// directory of its tasks).
    pub fn new(counters: Arc<JobCounters>, disk_path: PathBuf) -> Self {
        let system = System::new_with_specifics(
            RefreshKind::nothing()
                .with_cpu(CpuRefreshKind::nothing().with_cpu_usage())
                .with_memory(MemoryRefreshKind::nothing().with_ram()),
        );
        StatsCollector {
            started: Instant::now(),
            counters,
            system: Arc::new(Mutex::new(system)),
            disk_path,
            last: Arc::new(Mutex::new((0.0, 0, 0))),
            reading: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The job counters.
    pub fn counters(&self) -> &Arc<JobCounters> {
        &self.counters
    }

    /// Reads the current figures; `active_jobs` is the number of jobs running
    /// now. The host is read on a blocking thread, one reading at a time; a
    /// reading that takes over [`HOST_READ_WAIT`] (or one still running
    /// from before) gives the last figures instead. CPU usage is the
    /// average since the previous reading (0 on the first).
    pub async fn collect(&self, active_jobs: u32) -> WorkerStats {
        let cached = || *self.last.lock().unwrap_or_else(|e| e.into_inner());
        let host = if self.reading.swap(true, Ordering::SeqCst) {
            cached()
        } else {
            let system = Arc::clone(&self.system);
            let disk_path = self.disk_path.clone();
            let last = Arc::clone(&self.last);
            let reading = Arc::clone(&self.reading);
            let read = tokio::task::spawn_blocking(move || {
                let mut sys = system.lock().unwrap_or_else(|e| e.into_inner());
                sys.refresh_cpu_usage();
                sys.refresh_memory();
                let cpu = f64::from(sys.global_cpu_usage());
                let memory_mb = sys.used_memory() / (1024 * 1024);
                let figures = (cpu, memory_mb, disk_available_gb(&disk_path));
                *last.lock().unwrap_or_else(|e| e.into_inner()) = figures;
                reading.store(false, Ordering::SeqCst);
                figures
            });
            match tokio::time::timeout(HOST_READ_WAIT, read).await {
                Ok(Ok(figures)) => figures,
                Ok(Err(_)) => {
                    self.reading.store(false, Ordering::SeqCst);
                    cached()
                }
                Err(_) => cached(),
            }
        };
        WorkerStats {
            active_jobs,
            completed_jobs_total: self.counters.completed(),
            failed_jobs_total: self.counters.failed(),
            uptime_secs: self.started.elapsed().as_secs(),
            cpu_usage_percent: host.0,
            memory_mb: host.1,
            disk_available_gb: host.2,
            avg_job_duration_ms: self.counters.avg_duration_ms(),
        }
    }
}

/// Free space in GiB, for unprivileged users, of the file system that
/// holds `path` (`statvfs` of that path alone: no other mount is asked);
/// 0 when it cannot be read.
fn disk_available_gb(path: &Path) -> u64 {
    nix::sys::statvfs::statvfs(path).map_or(0, |v| {
        v.blocks_available().saturating_mul(v.fragment_size()) / (1024 * 1024 * 1024)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn collects_real_figures() {
        let counters = Arc::new(JobCounters::default());
        counters.record(true, Duration::from_millis(100));
        counters.record(false, Duration::from_millis(300));
        let c = StatsCollector::new(Arc::clone(&counters), std::env::temp_dir());
        let s = c.collect(2).await;
        assert_eq!(s.active_jobs, 2);
        assert_eq!(s.completed_jobs_total, 1);
        assert_eq!(s.failed_jobs_total, 1);
        assert_eq!(s.avg_job_duration_ms, 200);
        assert!(s.memory_mb > 0);
        assert!(
            s.disk_available_gb > 0,
            "the temporary directory's file system"
        );
        assert!((0.0..=100.0).contains(&s.cpu_usage_percent));
    }
}
