//! Random and mutated config texts through the parser and the health gate they configure:
//! neither may panic, whatever the file says.

use super::{BackendConfig, Config, ResourceConfig, ResourceKind};
use devplug::health::HealthGate;
use devplug::{Device, DeviceList, Health};
use std::path::Path;
use std::time::{Duration, Instant};

/// A small xorshift generator: the same inputs on every run, no dependency.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

/// A number as a config file may hold one: edge values and random digit strings.
fn number(rng: &mut XorShift) -> String {
    match rng.below(8) {
        2..=4 => rng.below(100).to_string(),
        0 => rng
            .pick(&[
                "0",
                "1",
                "59",
                "3600",
                "50000",
                "50001",
                "4294967295",
                "4294967296",
                "9223372036854775807",
                "18446744073709551615",
                "18446744073709551616",
                "300000000000000000",
                "-1",
                "1.5",
                "1e3",
            ])
            .to_owned(),
        1 => (0..rng.below(30) + 1)
            .map(|_| char::from(b'0' + rng.below(10) as u8))
            .collect(),
        _ => (rng.next() >> rng.below(64)).to_string(),
    }
}

fn duration_text(rng: &mut XorShift) -> String {
    let unit = rng.pick(&[
        "ms", "s", "m", "h", "ms", "s", "m", "h", "", "d", "us", " s", "S",
    ]);
    format!("{}{unit}", number(rng))
}

/// A config built from random parts: mostly valid shapes with random values.
fn generated(rng: &mut XorShift) -> String {
    let mut text = String::from("resources:\n");
    for i in 0..rng.below(3) + 1 {
        text.push_str(&format!("  - name: example.com/r{i}\n"));
        match rng.below(3) {
            0 => text.push_str(&format!(
                "    virtual: {{ count: {}, numa_nodes: {} }}\n",
                number(rng),
                number(rng)
            )),
            1 => text.push_str(&format!(
                "    hostdev: {{ groups: [ {{ paths: [/dev/null] }} ], count: {} }}\n",
                number(rng)
            )),
            _ => text.push_str(&format!("    files: {{ dir: /nonexistent/{i} }}\n")),
        }
        if rng.below(4) != 0 {
            text.push_str(&format!("    health_hold_down: {}\n", duration_text(rng)));
        }
    }
    text
}

/// `text` with a few random bytes replaced, inserted or removed.
fn mutated(rng: &mut XorShift, text: &str) -> String {
    let mut bytes = text.as_bytes().to_vec();
    let alphabet = b" \n:-{}[],0123456789hmsx\"'#&*!|>";
    for _ in 0..rng.below(4) + 1 {
        let at = rng.below(bytes.len() + 1);
        let byte = alphabet[rng.below(alphabet.len())];
        match rng.below(3) {
            0 if at < bytes.len() => bytes[at] = byte,
            1 if at < bytes.len() => {
                bytes.remove(at);
            }
            _ => bytes.insert(at, byte),
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Does what `run` does with a resource's timing: a device breaks, recovers and is
/// released after the hold-down, through the same gate the host uses.
fn drive_health_gate(resource: &ResourceConfig) {
    let hold = resource
        .health_hold_down
        .unwrap_or(devplug::host::DEFAULT_HEALTH_HOLD_DOWN);
    let list = |health: Health| DeviceList::new([Device::new("d").with_health(health)]);
    let mut gate = HealthGate::new(hold);
    let t0 = tokio::time::Instant::now();
    gate.apply(&list(Health::Healthy), t0);
    gate.apply(&list(Health::unhealthy("fuzz")), t0);
    let back = gate.apply(&list(Health::Healthy), t0);
    if let Some(next) = back.next_check {
        let released = gate.apply(&list(Health::Healthy), next);
        assert!(released
            .list
            .get("d")
            .is_some_and(|d| d.health.is_healthy()));
    }
}

#[test]
fn no_config_text_panics_the_parser_or_the_timing_it_configures() {
    let mut rng = XorShift(0x5eed_0008_2026_1123);
    let start = Instant::now();
    let (mut runs, mut accepted) = (0u32, 0u32);
    while runs < 20_000 && start.elapsed() < Duration::from_secs(3) {
        let base = generated(&mut rng);
        let text = if rng.below(3) == 0 {
            mutated(&mut rng, &base)
        } else {
            base
        };
        runs += 1;
        if let Ok(config) = Config::parse(&text, Path::new("fuzz.yaml")) {
            accepted += 1;
            for resource in &config.resources {
                drive_health_gate(resource);
                // Large lists are checked by the backend's own tests; keep runs quick.
                if let ResourceKind::Devices(BackendConfig::Virtual(settings)) = &resource.kind {
                    if settings.count > 2000 {
                        continue;
                    }
                    let backend = devplug_backends::VirtualBackend::new(settings).unwrap();
                    let devices = devplug::Backend::devices(&backend).borrow().clone();
                    devices.to_wire().unwrap();
                }
            }
        }
    }
    eprintln!("{runs} inputs, {accepted} valid configs");
    assert!(runs >= 200, "only {runs} inputs in the time budget");
    assert!(
        accepted > runs / 20,
        "too few valid configs ({accepted} of {runs}) to exercise the gate"
    );
}
