//! The lock a change holds, and one durable checkpoint write shared by the calls queued on it.
//!
//! A change (a prepare's or unprepare's backend calls, specs and checkpoint edits) holds the
//! driver's mutex and the node-wide file lock (`node_lock`), and its claims may be answered
//! only once the checkpoint holding them is on disk (fsynced). Written call by call, a burst of
//! pods on one node waits for one fsync after another. So a call that made its change while
//! other calls wait for the lock leaves the write to them: it hands the file lock over to the
//! next holder of the mutex (the *carry*: the lock and the calls whose changes are not on disk
//! yet) and waits for the outcome. The call that finds nobody waiting writes once for the
//! whole group, with the file lock held from the group's first change to that write, so no
//! other instance of the driver reads or overwrites a change before it is durable. When that
//! write fails, every member's change is undone, newest first (a prepared claim taken out, its
//! spec removed, its devices given back; an unprepared claim put back), and each member answers
//! its claims with the error, as a call that writes alone does.
//!
//! Nothing is lost when a call is cancelled (the kubelet gave up on it): a carry left by a
//! dropped holder goes back where the next holder takes it, and the members waiting for it are
//! woken to take the lock and write it themselves when no other call comes.

use super::node_lock;
use super::{conflicts::whole_ids, handover, ChangeGuard, Preparer};
use crate::checkpoint::{Checkpoint, FileStamp, PreparedClaim};
use crate::prepare::{claim_spec, PrepareError};
use std::collections::BTreeSet;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use tokio::sync::oneshot;

/// What a change did to the driver's state, to take it back when its write fails.
#[derive(Debug, Default)]
pub(super) enum Undo {
    /// Nothing changed.
    #[default]
    Nothing,
    /// These claims (by UID) were prepared: taken out, their specs removed, devices released.
    Prepared(Vec<String>),
    /// These claims were unprepared (what the backend made is released already): put back.
    Unprepared(Vec<(String, PreparedClaim)>),
}

impl Undo {
    fn is_nothing(&self) -> bool {
        match self {
            Undo::Nothing => true,
            Undo::Prepared(uids) => uids.is_empty(),
            Undo::Unprepared(claims) => claims.is_empty(),
        }
    }
}

/// A call whose change waits for the group's write.
#[derive(Debug)]
struct Member {
    undo: Undo,
    done: oneshot::Sender<Result<(), PrepareError>>,
}

/// The file lock and the changes not on disk yet, handed from one holder of the mutex to the
/// next.
#[derive(Debug, Default)]
pub(super) struct Carry {
    /// The node-wide lock, released when dropped (`None` where it could not be taken:
    /// logged).
    _file: Option<std::fs::File>,
    members: Vec<Member>,
}

/// Counts a call waiting for the mutex; wakes the carry's members when the call is dropped
/// before it got there (nobody may come to write for them).
struct Waiting<'a>(&'a Preparer, bool);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, SeqCst);
        if !self.1 {
            self.0.abandoned.notify_waiters();
        }
    }
}

impl Drop for ChangeGuard<'_> {
    fn drop(&mut self) {
        // A holder dropped with members unsettled (its call was cancelled): the carry goes
        // back for the next holder, and the members are woken in case there is none.
        if let Some(carry) = self.carry.take() {
            if !carry.members.is_empty() {
                if let Ok(mut slot) = self.preparer.carried.lock() {
                    *slot = Some(carry);
                }
                self.preparer.abandoned.notify_waiters();
            }
        }
    }
}

impl Preparer {
    /// The state for a change: the driver's mutex, then the node-wide lock on the checkpoint
    /// (carried over from the last holder when its change waits for a write, else taken), then,
    /// when taken anew, the checkpoint read again if another instance wrote it since this one
    /// did (the shares it prepared told to the backend, as at a start).
    pub(super) async fn lock_for_change(&self) -> ChangeGuard<'_> {
        self.waiting.fetch_add(1, SeqCst);
        let mut waiting = Waiting(self, false);
        let mut state = self.state.lock().await;
        waiting.1 = true;
        drop(waiting);
        let carried = self.carried.lock().ok().and_then(|mut slot| slot.take());
        if let Some(carry) = carried {
            // The lock was held since the carry's first change: nobody else wrote.
            return ChangeGuard {
                preparer: self,
                state,
                carry: Some(carry),
            };
        }
        let file = match node_lock::lock(&self.files.checkpoint).await {
            Ok(file) => Some(file),
            Err(err) => {
                tracing::warn!(driver = %self.driver, path = %node_lock::lock_path(&self.files.checkpoint).display(), %err, "cannot take the checkpoint's lock: another instance of the driver may change it meanwhile");
                None
            }
        };
        let now = FileStamp::of(&self.files.checkpoint);
        let known = self.stamp.lock().map(|s| *s).unwrap_or(None);
        if now != known {
            self.reload(&mut state, now).await;
        }
        ChangeGuard {
            preparer: self,
            state,
            carry: Some(Carry {
                _file: file,
                members: Vec::new(),
            }),
        }
    }

    /// The checkpoint another instance wrote, read again into `state`.
    async fn reload(&self, state: &mut Checkpoint, now: Option<FileStamp>) {
        match Checkpoint::load(&self.files.checkpoint, &self.driver) {
            Ok(fresh) => {
                let new_shares: Vec<String> = fresh
                    .claims
                    .iter()
                    .filter(|(uid, _)| !state.claims.contains_key(*uid))
                    .flat_map(|(_, claim)| &claim.devices)
                    .filter(|d| d.hold.share_id().is_some())
                    .map(|d| d.id.clone())
                    .collect::<BTreeSet<_>>()
                    .into_iter()
                    .collect();
                tracing::info!(driver = %self.driver, claims = fresh.claims.len(), was = state.claims.len(), "the checkpoint was written by another instance of the driver: read again");
                *state = fresh;
                self.set_stamp(now);
                self.saved.send_replace(Arc::new(state.claims.clone()));
                handover::restore_shares(self.backend.clone(), new_shares).await;
            }
            Err(err) => {
                tracing::error!(driver = %self.driver, %err, "the checkpoint another instance wrote cannot be read; this instance's claims are kept");
            }
        }
    }

    /// Makes the change held by `guard` (`own`, and the carry's members') durable: handed to
    /// the next holder when calls wait for the lock, else written now. `Err` when the write
    /// failed: `own` was undone then, as every member's change.
    pub(super) async fn commit(
        &self,
        mut guard: ChangeGuard<'_>,
        own: Undo,
    ) -> Result<(), PrepareError> {
        let mut carry = guard.carry.take().unwrap_or_default();
        if own.is_nothing() && carry.members.is_empty() {
            // Nothing to write: the lock is released with the guard.
            return Ok(());
        }
        if !own.is_nothing() && self.waiting.load(SeqCst) > 0 {
            let (done, outcome) = oneshot::channel();
            carry.members.push(Member { undo: own, done });
            // Woken when the carry is left with nobody to take it; registered before it is
            // handed over, so no wake is missed.
            let abandoned = self.abandoned.notified();
            tokio::pin!(abandoned);
            abandoned.as_mut().enable();
            if let Ok(mut slot) = self.carried.lock() {
                *slot = Some(carry);
            }
            drop(guard);
            return self.wait_for_group(outcome, abandoned).await;
        }
        let written = self.save(&guard.state).await;
        match written {
            Ok(()) => {
                for member in carry.members {
                    let _ = member.done.send(Ok(()));
                }
                Ok(())
            }
            Err(err) => {
                self.undo(&mut guard.state, own).await;
                for member in carry.members.iter_mut().rev() {
                    let undo = std::mem::take(&mut member.undo);
                    self.undo(&mut guard.state, undo).await;
                }
                for member in carry.members {
                    let _ = member.done.send(Err(err.clone()));
                }
                Err(err)
            }
        }
    }

    /// Waits for the outcome of the group's write; when the carry was left with nobody to take
    /// it, takes the lock and writes it.
    async fn wait_for_group<'a>(
        &'a self,
        mut outcome: oneshot::Receiver<Result<(), PrepareError>>,
        mut abandoned: std::pin::Pin<&mut tokio::sync::futures::Notified<'a>>,
    ) -> Result<(), PrepareError> {
        loop {
            tokio::select! {
                result = &mut outcome => {
                    return result.unwrap_or_else(|_| Err(PrepareError::WriteCheckpoint {
                        path: self.files.checkpoint.clone(),
                        source: Arc::new(std::io::Error::other("the group write this call waited for was dropped")),
                    }));
                }
                () = abandoned.as_mut() => {
                    abandoned.set(self.abandoned.notified());
                    abandoned.as_mut().enable();
                    // The carry, if still left, is this holder's to write (with no change of
                    // its own); if another holder took it, nothing happens here.
                    let guard = self.lock_for_change().await;
                    let _ = Box::pin(self.commit(guard, Undo::Nothing)).await;
                }
            }
        }
    }

    /// Takes back one change whose write failed.
    async fn undo(&self, state: &mut Checkpoint, undo: Undo) {
        match undo {
            Undo::Nothing => {}
            Undo::Prepared(uids) => {
                for uid in uids.iter().rev() {
                    if let Some(undone) = state.claims.remove(uid) {
                        let _ = claim_spec::remove(&undone.cdi_spec);
                        handover::release_after_failure(
                            &self.driver,
                            &self.backend,
                            whole_ids(&undone.devices),
                        )
                        .await;
                    }
                }
            }
            Undo::Unprepared(claims) => {
                for (uid, claim) in claims {
                    state.claims.insert(uid, claim);
                }
            }
        }
    }
}
