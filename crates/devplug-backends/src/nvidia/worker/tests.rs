//! Tests of `worker.rs`.

//! The worker on a scripted driver (no NVML): the paths the fake library cannot reach.
use super::*;
use crate::nvidia::seam::{GpuInfo, RecoveryAction, Snapshot};
use std::collections::VecDeque;

struct Scripted {
    /// How often the driver was opened (NVML initialised).
    opens: Arc<std::sync::atomic::AtomicUsize>,
    failures: VecDeque<String>,
    snapshot: Result<Snapshot, String>,
    events: Arc<Mutex<VecDeque<RawEvent>>>,
    /// The timeout of every wait asked for, in order.
    waits: Arc<Mutex<Vec<Duration>>>,
}

struct Session<'a>(&'a mut Scripted);

impl GpuSession for Session<'_> {
    fn snapshot(&mut self) -> Result<Snapshot, String> {
        self.0.snapshot.clone()
    }
    fn recovery_action(&mut self, _: u32) -> Result<Option<RecoveryAction>, String> {
        Ok(Some(RecoveryAction::GpuReset))
    }
    fn probe(&mut self, _: u32, _: &str) -> bool {
        true
    }
    fn arm(&mut self, _: &[GpuInfo], _: bool, _: bool) -> Result<Vec<(String, String)>, String> {
        Ok(Vec::new())
    }
    /// Returns as soon as an event is queued, as NVML's wait does.
    fn wait(&mut self, timeout: Duration) -> Result<RawEvent, WaitError> {
        self.0.waits.lock().unwrap().push(timeout);
        let until = Instant::now() + timeout;
        loop {
            if let Some(event) = self.0.events.lock().unwrap().pop_front() {
                return Ok(event);
            }
            if Instant::now() >= until {
                return Err(WaitError::Timeout);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl GpuDriver for Scripted {
    fn open(
        &mut self,
        body: &mut dyn FnMut(&mut dyn GpuSession) -> SessionEnd,
    ) -> Result<SessionEnd, String> {
        self.opens.fetch_add(1, Ordering::SeqCst);
        if let Some(reason) = self.failures.pop_front() {
            return Err(reason);
        }
        Ok(body(&mut Session(self)))
    }
}

fn gpu(index: u32) -> GpuInfo {
    GpuInfo {
        index,
        uuid: format!("GPU-{index}"),
        name: "NVIDIA L4".into(),
        minor: index,
        memory_bytes: 1,
        bus_id: format!("0000:0{index}:00.0"),
        nvlinks: Vec::new(),
        compute_capability: None,
        mig_capable: false,
        mig_enabled: false,
        migs: Vec::new(),
        mig_profiles: Vec::new(),
    }
}

fn start(driver: Scripted) -> (Arc<Shared>, std::sync::mpsc::Sender<()>) {
    let mut settings = NvidiaSettings::default();
    settings.health.check_interval_ms = 10;
    settings.sys_root = std::env::temp_dir();
    let empty = View::build(&settings, &Snapshot::default());
    let shared = Arc::new(Shared {
        view: RwLock::new(Arc::new(empty)),
        devices: watch::Sender::new(DeviceList::default()),
        not_ready: RwLock::new(None),
        health_unknown: RwLock::new(None),
        cdi_ready: AtomicBool::new(false),
        stop: AtomicBool::new(false),
        cdi: Mutex::new(None),
        discovered: watch::Sender::new(false),
        labels: watch::Sender::new(crate::NodeLabels::new()),
        settings: Arc::new(settings.clone()),
    });
    let (wake, wake_rx) = std::sync::mpsc::channel();
    let for_thread = shared.clone();
    std::thread::spawn(move || run(Box::new(driver), Arc::new(settings), for_thread, wake_rx));
    (shared, wake)
}

fn until(what: &str, f: impl Fn() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(10), "never: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn not_ready_with_the_reason_until_the_driver_opens_and_a_wake_retries_at_once() {
    let events = Arc::new(Mutex::new(VecDeque::new()));
    let driver = Scripted {
        opens: Arc::default(),
        failures: VecDeque::from(["the NVIDIA driver is not loaded".to_owned()]),
        snapshot: Ok(Snapshot {
            gpus: vec![gpu(0), gpu(1)],
            lost: Vec::new(),
            pcie: vec![vec![None; 2]; 2],
        }),
        events: events.clone(),
        waits: Arc::default(),
    };
    let (shared, wake) = start(driver);
    until("not ready", || {
        shared.not_ready.read().unwrap().as_deref()
            == Some("NVML not available: the NVIDIA driver is not loaded")
    });
    let started = Instant::now();
    wake.send(()).unwrap();
    until("2 devices", || shared.devices.borrow().healthy_count() == 2);
    assert!(
        started.elapsed() < Duration::from_millis(450),
        "the wake did not retry"
    );
    assert_eq!(*shared.not_ready.read().unwrap(), None);
    // An XID reaches both devices' health through the event path.
    events.lock().unwrap().push_back(RawEvent::Xid {
        uuid: "GPU-1".into(),
        xid: 48,
        gi: None,
        ci: None,
    });
    until("GPU-1 unhealthy", || {
        shared.devices.borrow().healthy_count() == 1
    });
    shared.stop.store(true, Ordering::Release);
}

#[test]
fn a_failed_discovery_is_a_reason_and_a_retry_not_an_exit() {
    let driver = Scripted {
        opens: Arc::default(),
        failures: VecDeque::new(),
        snapshot: Err("GPU 3: uuid: Unknown Error".into()),
        events: Arc::default(),
        waits: Arc::default(),
    };
    let (shared, _wake) = start(driver);
    until("reason", || {
        shared.not_ready.read().unwrap().as_deref()
            == Some("GPU discovery failed: GPU 3: uuid: Unknown Error")
    });
    assert!(shared.devices.borrow().is_empty());
    shared.stop.store(true, Ordering::Release);
}

#[test]
fn a_discovery_that_keeps_failing_is_retried_with_a_growing_backoff() {
    let opens: Arc<std::sync::atomic::AtomicUsize> = Arc::default();
    let driver = Scripted {
        opens: opens.clone(),
        failures: VecDeque::new(),
        snapshot: Err("GPU 6: uuid: GPU is lost".into()),
        events: Arc::default(),
        waits: Arc::default(),
    };
    let (shared, _wake) = start(driver);
    // Backoff 0.5 s, 1 s, 2 s: opens at 0, 0.5, 1.5 and 3.5 s. A backoff that starts
    // over at every open would open every 0.5 s (7 times in 3.2 s).
    std::thread::sleep(Duration::from_millis(3200));
    let n = opens.load(Ordering::SeqCst);
    assert!((2..=4).contains(&n), "NVML opened {n} times in 3.2 s");
    shared.stop.store(true, Ordering::Release);
}

#[test]
fn healthy_gpus_need_no_tick_a_faulted_one_does_until_it_recovers() {
    let events = Arc::new(Mutex::new(VecDeque::new()));
    let waits: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let driver = Scripted {
        opens: Arc::default(),
        failures: VecDeque::new(),
        snapshot: Ok(Snapshot {
            gpus: vec![gpu(0)],
            lost: Vec::new(),
            pcie: vec![vec![None]],
        }),
        events: events.clone(),
        waits: waits.clone(),
    };
    let (shared, _wake) = start(driver);
    until("listed", || shared.devices.borrow().healthy_count() == 1);
    until("waiting", || !waits.lock().unwrap().is_empty());
    assert_eq!(waits.lock().unwrap()[0], IDLE_WAIT, "healthy: no tick");
    events.lock().unwrap().push_back(RawEvent::Xid {
        uuid: "GPU-0".into(),
        xid: 48,
        gi: None,
        ci: None,
    });
    until("unhealthy", || shared.devices.borrow().healthy_count() == 0);
    // Waiting for its recovery check: the tick (10 ms here), as often as it takes.
    until("ticking", || {
        waits
            .lock()
            .unwrap()
            .iter()
            .filter(|&&w| w == Duration::from_millis(10))
            .count()
            >= 3
    });
    shared.stop.store(true, Ordering::Release);
}
