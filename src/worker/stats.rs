//! The load and health figures every heartbeat carries, read from the host
//! with `sysinfo` and from the worker's own counters.

use std::{
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use sysinfo::{CpuRefreshKind, Disks, MemoryRefreshKind, RefreshKind, System};

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
}

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
        }
    }

    /// The job counters.
    pub fn counters(&self) -> &Arc<JobCounters> {
        &self.counters
    }

    /// Reads the current figures; `active_jobs` is the number of jobs running
    /// now. The host is read on a blocking thread. CPU usage is the average
    /// since the previous call (0 on the first).
    pub async fn collect(&self, active_jobs: u32) -> WorkerStats {
        let system = Arc::clone(&self.system);
        let disk_path = self.disk_path.clone();
        let host = tokio::task::spawn_blocking(move || {
            let mut sys = system.lock().unwrap_or_else(|e| e.into_inner());
            sys.refresh_cpu_usage();
            sys.refresh_memory();
            let cpu = f64::from(sys.global_cpu_usage());
            let memory_mb = sys.used_memory() / (1024 * 1024);
            (cpu, memory_mb, disk_available_gb(&disk_path))
        })
        .await
        .unwrap_or((0.0, 0, 0));
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

/// Free space in GiB of the mounted filesystem that holds `path` (the mount
/// point that is its longest prefix); 0 when none matches.
fn disk_available_gb(path: &Path) -> u64 {
    let path = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let disks = Disks::new_with_refreshed_list();
    disks
        .list()
        .iter()
        .filter(|d| path.starts_with(d.mount_point()))
        .max_by_key(|d| d.mount_point().as_os_str().len())
        .map(|d| d.available_space() / (1024 * 1024 * 1024))
        .unwrap_or(0)
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
        assert!((0.0..=100.0).contains(&s.cpu_usage_percent));
    }
}
