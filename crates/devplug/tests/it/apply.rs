//! `Host::apply`: a new set of resources applied to a running host, as a config reload does.

use crate::support::{kubelet, wait_capacity, TestBackend};
use devplug::host::{ApplyFailure, Updated};
use devplug::{Backend, Host, ResourceSettings};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// A stand-in for a config entry: a device count, or a broken entry.
#[derive(Debug, Clone, PartialEq)]
enum Entry {
    Devices(usize),
    Broken,
}

fn build(_: &str, entry: &Entry) -> Result<(Arc<dyn Backend>, ResourceSettings), String> {
    match entry {
        Entry::Devices(n) => Ok((Arc::new(TestBackend::new(*n)), ResourceSettings::default())),
        Entry::Broken => Err("devices: must be a number".to_owned()),
    }
}

fn wanted(entries: &[(&str, Entry)]) -> BTreeMap<String, Entry> {
    entries
        .iter()
        .map(|(name, entry)| ((*name).to_owned(), entry.clone()))
        .collect()
}

#[tokio::test]
async fn apply_adds_swaps_removes_and_keeps_what_is_unchanged() {
    let (dir, kubelet) = kubelet(Duration::from_secs(300)).await;
    let host = Host::new(dir.path()).unwrap();
    let mut applied = BTreeMap::new();

    let first = host
        .apply(
            &mut applied,
            wanted(&[
                ("example.com/a", Entry::Devices(1)),
                ("example.com/b", Entry::Devices(2)),
                ("example.com/c", Entry::Devices(3)),
            ]),
            build,
        )
        .await;
    assert_eq!(
        first.added,
        ["example.com/a", "example.com/b", "example.com/c"]
    );
    assert!(first.is_complete());
    wait_capacity(&kubelet, "example.com/a", (1, 1)).await;
    wait_capacity(&kubelet, "example.com/b", (2, 2)).await;
    wait_capacity(&kubelet, "example.com/c", (3, 3)).await;

    // a unchanged, b changed, c gone, d new, e broken.
    let second = host
        .apply(
            &mut applied,
            wanted(&[
                ("example.com/a", Entry::Devices(1)),
                ("example.com/b", Entry::Devices(4)),
                ("example.com/d", Entry::Devices(5)),
                ("example.com/e", Entry::Broken),
            ]),
            build,
        )
        .await;
    assert_eq!(second.unchanged, ["example.com/a"]);
    assert_eq!(
        second.changed,
        [("example.com/b".to_owned(), Updated::InPlace)]
    );
    assert_eq!(second.removed, ["example.com/c"]);
    assert_eq!(second.added, ["example.com/d"]);
    assert_eq!(second.failed.len(), 1);
    let failure = &second.failed[0];
    assert!(matches!(failure, ApplyFailure::Build { .. }), "{failure:?}");
    assert_eq!(
        failure.to_string(),
        "example.com/e: devices: must be a number"
    );
    wait_capacity(&kubelet, "example.com/b", (4, 4)).await;
    wait_capacity(&kubelet, "example.com/d", (5, 5)).await;
    // The unchanged and the swapped resource kept their one stream; c's ended.
    for resource in ["example.com/a", "example.com/b"] {
        assert_eq!(
            kubelet.read(|n| n.resource(resource).unwrap().connections()),
            1,
            "{resource}: stream untouched"
        );
    }
    assert_eq!(
        host.resources(),
        ["example.com/a", "example.com/b", "example.com/d"]
    );
    assert_eq!(
        applied.keys().collect::<Vec<_>>(),
        ["example.com/a", "example.com/b", "example.com/d"],
        "the broken entry is not recorded as applied"
    );

    // A name the kubelet would refuse: the host says why, the others stay.
    let third = host
        .apply(
            &mut applied,
            wanted(&[
                ("example.com/a", Entry::Devices(1)),
                ("not a resource name", Entry::Devices(1)),
            ]),
            build,
        )
        .await;
    assert!(
        matches!(third.failed[..], [ApplyFailure::Serve { .. }]),
        "{:?}",
        third.failed
    );
    assert_eq!(third.failed[0].resource(), "not a resource name");
    assert_eq!(third.removed, ["example.com/b", "example.com/d"]);
    host.shutdown().await;
}
