//! The checkpoint write: a call whose write fails is undone whole; calls queued on the lock
//! share one write, and a shared write that fails undoes every call of the group.

use super::*;

/// One `prepare` call per claim, all at once (as the kubelet makes for pods landing on the
/// node together).
async fn prepare_each(
    preparer: &Preparer,
    claims: &[ClaimRef],
) -> Vec<ClaimResults<Vec<PreparedDevice>>> {
    futures_util::future::join_all(
        claims
            .iter()
            .map(|c| preparer.prepare(std::slice::from_ref(c))),
    )
    .await
}

#[tokio::test]
async fn a_checkpoint_that_cannot_be_written_undoes_the_whole_call() {
    let dir = tempfile::tempdir().unwrap();
    let files = files_in_driver_folder(dir.path());
    let list = DeviceList::new((0..3).map(|i| Device::new(format!("npu-{i}"))));
    let (tx, _) = watch::channel(list);
    let claims = Fixed(HashMap::from([
        ("a".to_owned(), vec![allocated("x", "npu-0")]),
        ("b".to_owned(), vec![allocated("x", "npu-1")]),
        ("c".to_owned(), vec![allocated("x", "npu-2")]),
    ]));
    let preparer = npu_preparer(tx, claims, &files);
    assert!(preparer.prepare(&[claim("a")]).await["a"].is_ok());
    // The checkpoint's folder turns into a file: no write can succeed.
    let folder = dir.path().join("driver");
    std::fs::rename(&folder, dir.path().join("driver-moved")).unwrap();
    std::fs::write(&folder, "not a folder").unwrap();
    let both = preparer
        .prepare(&[claim("b"), claim("c"), claim("a")])
        .await;
    for uid in ["b", "c"] {
        let err = both[uid].as_ref().unwrap_err().to_string();
        assert!(err.contains("cannot write the checkpoint"), "{err}");
        assert!(!spec_path(&files.cdi_dir, "npu.example.com", uid).exists());
    }
    assert!(both["a"].is_ok(), "prepared before: answered from memory");
    assert_eq!(preparer.prepared().await.len(), 1);
    let gone = preparer.unprepare(&[claim("a")]).await;
    assert!(gone["a"]
        .as_ref()
        .unwrap_err()
        .to_string()
        .contains("cannot write the checkpoint"));
    assert_eq!(preparer.prepared().await.len(), 1, "still prepared");
    std::fs::remove_file(&folder).unwrap();
    std::fs::rename(dir.path().join("driver-moved"), &folder).unwrap();
    assert!(preparer
        .prepare(&[claim("b"), claim("c")])
        .await
        .values()
        .all(Result::is_ok));
    assert!(preparer
        .unprepare(&[claim("a"), claim("b"), claim("c")])
        .await
        .values()
        .all(Result::is_ok));
    assert!(preparer.prepared().await.is_empty());
}

/// A driver's files in `dir`: CDI specs in `cdi`, the checkpoint in a folder of its own,
/// `driver` (which the tests of failed writes turn into a file).
fn files_in_driver_folder(dir: &Path) -> PrepareFiles {
    PrepareFiles {
        cdi_dir: dir.join("cdi"),
        checkpoint: dir.join("driver/checkpoint.json"),
    }
}

/// A preparer of eight NPUs and claims `c0`..`c7`, one NPU each.
fn eight_npus(files: &PrepareFiles) -> Preparer {
    let list = DeviceList::new((0..8).map(|i| Device::new(format!("npu-{i}"))));
    let (tx, _) = watch::channel(list);
    let claims = Fixed(
        (0..8)
            .map(|i| (format!("c{i}"), vec![allocated("x", &format!("npu-{i}"))]))
            .collect(),
    );
    npu_preparer(tx, claims, files)
}

#[tokio::test]
async fn calls_queued_on_the_lock_share_one_checkpoint_write() {
    let dir = tempfile::tempdir().unwrap();
    let files = files_in_driver_folder(dir.path());
    let preparer = eight_npus(&files);
    let claims: Vec<ClaimRef> = (0..8).map(|i| claim(&format!("c{i}"))).collect();
    // Eight calls at once, as the kubelet makes for eight pods landing on the node together.
    let results = prepare_each(&preparer, &claims).await;
    assert!(results.iter().all(|r| r.values().all(Result::is_ok)));
    let writes = preparer.checkpoint_writes();
    assert!(
        writes <= 2,
        "{writes} checkpoint writes for 8 calls queued together"
    );
    // Every claim is on disk: a new instance reads them all.
    let again = eight_npus(&files);
    assert_eq!(again.prepared().await.len(), 8);
    // The same for unprepares.
    let results = futures_util::future::join_all(
        claims
            .iter()
            .map(|c| again.unprepare(std::slice::from_ref(c))),
    )
    .await;
    assert!(results.iter().all(|r| r.values().all(Result::is_ok)));
    assert!(again.checkpoint_writes() <= 2);
    assert!(eight_npus(&files).prepared().await.is_empty());
}

#[tokio::test]
async fn a_shared_write_that_fails_undoes_every_call_of_the_group() {
    let dir = tempfile::tempdir().unwrap();
    let files = files_in_driver_folder(dir.path());
    let preparer = eight_npus(&files);
    assert!(preparer.prepare(&[claim("c0")]).await["c0"].is_ok());
    // The checkpoint's folder turns into a file: no write can succeed.
    let folder = dir.path().join("driver");
    std::fs::rename(&folder, dir.path().join("driver-moved")).unwrap();
    std::fs::write(&folder, "not a folder").unwrap();
    let uids: Vec<String> = (1..8).map(|i| format!("c{i}")).collect();
    let claims: Vec<ClaimRef> = uids.iter().map(|uid| claim(uid)).collect();
    let first = [claim("c0")];
    let (prepared, unprepared) =
        tokio::join!(preparer.unprepare(&first), prepare_each(&preparer, &claims),);
    let (prepared, unprepared) = (unprepared, prepared);
    for (uid, result) in uids.iter().zip(&prepared) {
        let err = result[uid].as_ref().unwrap_err().to_string();
        assert!(err.contains("cannot write the checkpoint"), "{uid}: {err}");
        assert!(!spec_path(&files.cdi_dir, "npu.example.com", uid).exists());
    }
    assert!(unprepared["c0"].is_err(), "its write failed too");
    let left: Vec<String> = preparer.prepared().await.into_keys().collect();
    assert_eq!(
        left,
        ["c0"],
        "every member undone, the unprepare's claim put back"
    );
    // Once the folder is back, the devices the failed calls held are free again.
    std::fs::remove_file(&folder).unwrap();
    std::fs::rename(dir.path().join("driver-moved"), &folder).unwrap();
    let results = prepare_each(&preparer, &claims).await;
    assert!(results.iter().all(|r| r.values().all(Result::is_ok)));
    assert_eq!(preparer.prepared().await.len(), 8);
}
