//! A registration socket in the kubelet's plugin-watcher folder (`plugins_registry/`), kept
//! offered for one plugin: the one building block behind the device plugins' watcher route
//! ([`crate::Registration::Watcher`]) and devplug's DRA driver.
//!
//! - It is bound under a dot-name and renamed into place (`socket::bind_owner_only`): the
//!   watcher ignores dot-names, so it only ever sees a socket that is already served.
//! - It serves `pluginregistration.Registration`: `GetInfo` from memory (the kubelet gives it
//!   1 s) and `NotifyRegistrationStatus`, published on [`RegistrationSocket::registered`].
//! - Deleted (an operator, a script, a kubelet cleaning up): created again at once, as the
//!   folder's inotify events say.
//! - Refused: the kubelet never retries a failed registration (kubernetes#133725), so the socket
//!   is removed and offered again after a delay that doubles while it keeps refusing
//!   ([`RefusedRetry`]).
//! - The folder missing: it is offered as soon as the folder is there.
//! - [`RegistrationSocket::reoffer`]: offered again now, for an owner that knows the kubelet
//!   lost it (the device plugin route's stream that did not come back).

use super::backoff::Backoff;
use super::dir_watch::{self, next_news, DirEvent, FolderNews, FolderState};
use super::resource::{bind_error, far_future, Served};
use devplug_proto::pluginregistration::{
    self as pr, registration_server::RegistrationServer, InfoRequest, PluginInfo,
    RegistrationStatus, RegistrationStatusResponse,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{broadcast, mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::{sleep_until, Instant};
use tokio_util::sync::CancellationToken;

/// Binding a socket: errors here are about permissions or space, not races.
const BIND_FIRST: Duration = Duration::from_millis(100);
const BIND_MAX: Duration = Duration::from_secs(10);

/// How long to wait before offering the registration socket again after the kubelet refused it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefusedRetry {
    /// The first delay.
    pub first: Duration,
    /// The longest delay (the delay doubles while the kubelet keeps refusing).
    pub max: Duration,
}

impl Default for RefusedRetry {
    fn default() -> Self {
        RefusedRetry {
            first: Duration::from_secs(1),
            max: Duration::from_secs(60),
        }
    }
}

/// What the kubelet last said about a registration.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Registered {
    /// Nothing yet (no kubelet found the socket, or it is being offered again).
    #[default]
    Waiting,
    /// Registered.
    Yes,
    /// Refused, with the kubelet's reason.
    Refused(String),
}

/// What happened to the socket, for an owner that keeps its own status and counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RegistrationEvent {
    /// A fresh socket is in place: a new registration attempt.
    Offered,
    /// The kubelet registered us; `again`: through the same socket as before (a new kubelet
    /// found it).
    Registered {
        /// Registered through a socket that was registered before.
        again: bool,
    },
    /// The kubelet refused us; the socket is offered again after a delay.
    Refused {
        /// The kubelet's reason.
        error: String,
    },
    /// Our socket was removed by someone else; it is offered again.
    Withdrawn,
}

/// Called just before each offer (the host starts a new stream attempt there).
pub(crate) type OnOffer = Arc<dyn Fn() + Send + Sync>;

/// One registration socket, kept offered until [`RegistrationSocket::stop`].
pub struct RegistrationSocket {
    registered: watch::Receiver<Registered>,
    folder: watch::Receiver<FolderState>,
    reoffer: mpsc::UnboundedSender<()>,
    stop: CancellationToken,
    task: JoinHandle<Option<String>>,
}

impl RegistrationSocket {
    /// Offers `info` at `path` (in the plugin watcher's folder) and keeps it offered: follows
    /// the folder with inotify of its own. Fails only if inotify is unavailable.
    pub fn start(
        info: PluginInfo,
        path: PathBuf,
        refused_retry: RefusedRetry,
    ) -> std::io::Result<RegistrationSocket> {
        let stop = CancellationToken::new();
        let folder = path.parent().unwrap_or(Path::new("."));
        let folder = dir_watch::watch(folder, stop.clone())?;
        let events = folder.events.subscribe();
        Ok(Self::start_with(
            Offering {
                info,
                path,
                refused_retry,
                events,
                folder: folder.state,
                on_offer: None,
                report: None,
            },
            stop,
        ))
    }

    /// Starts offering with the host's own folder follower, reporting to `offering.report`.
    pub(crate) fn start_with(offering: Offering, stop: CancellationToken) -> RegistrationSocket {
        let (registered_tx, registered) = watch::channel(Registered::Waiting);
        let (reoffer, reoffers) = mpsc::unbounded_channel();
        let folder = offering.folder.clone();
        let task = tokio::spawn(offering.run(registered_tx, reoffers, stop.clone()));
        RegistrationSocket {
            registered,
            folder,
            reoffer,
            stop,
            task,
        }
    }

    /// What the kubelet last said.
    pub fn registered(&self) -> watch::Receiver<Registered> {
        self.registered.clone()
    }

    /// Whether the plugin watcher's folder can be followed, as a handle that outlives this
    /// borrow (for a health endpoint).
    pub fn folder_health(&self) -> FolderHealth {
        FolderHealth(self.folder.clone())
    }

    /// Removes the socket and offers it again now, so the watcher sees a new plugin.
    pub fn reoffer(&self) {
        let _ = self.reoffer.send(());
    }

    /// Stops serving and removes the socket; returns what could not be removed, with why.
    pub async fn stop(self) -> Option<String> {
        self.stop.cancel();
        self.task.await.ok().flatten()
    }
}

/// Whether a followed folder can be followed: see [`FolderHealth::check`].
#[derive(Debug, Clone)]
pub struct FolderHealth(watch::Receiver<FolderState>);

impl FolderHealth {
    /// `Err` with the reason while the folder cannot be followed (its path is a file, no
    /// ancestor can be watched): nothing can be offered in it until that clears. A missing
    /// folder is waited for, not a failure.
    pub fn check(&self) -> Result<(), String> {
        match &*self.0.borrow() {
            FolderState::Broken(reason) => Err(reason.clone()),
            FolderState::Present | FolderState::Missing { .. } => Ok(()),
        }
    }
}

/// Everything the offering task needs.
pub(crate) struct Offering {
    pub(crate) info: PluginInfo,
    pub(crate) path: PathBuf,
    pub(crate) refused_retry: RefusedRetry,
    pub(crate) events: broadcast::Receiver<DirEvent>,
    pub(crate) folder: watch::Receiver<FolderState>,
    pub(crate) on_offer: Option<OnOffer>,
    pub(crate) report: Option<mpsc::UnboundedSender<RegistrationEvent>>,
}

/// What `NotifyRegistrationStatus` said, tagged with the socket it came through.
struct Note {
    generation: u64,
    registered: bool,
    error: String,
}

impl Offering {
    fn report(&self, event: RegistrationEvent) {
        if let Some(report) = &self.report {
            let _ = report.send(event);
        }
    }

    async fn run(
        mut self,
        registered: watch::Sender<Registered>,
        mut reoffers: mpsc::UnboundedReceiver<()>,
        stop: CancellationToken,
    ) -> Option<String> {
        let name = self.info.name.clone();
        let (notes_tx, mut notes) = mpsc::unbounded_channel();
        let mut current: Option<Served> = None;
        let mut generation: u64 = 0;
        // The socket generation the kubelet last accepted.
        let mut accepted: Option<u64> = None;
        let mut bind_backoff = Backoff::new(BIND_FIRST, BIND_MAX);
        let mut refused_backoff = Backoff::new(self.refused_retry.first, self.refused_retry.max);
        let mut bind_at: Option<Instant> = None;
        let mut offer_at: Option<Instant> = None;
        let mut folder_logged = false;

        loop {
            let folder_present = matches!(*self.folder.borrow_and_update(), FolderState::Present);
            if !current.as_ref().is_some_and(Served::is_linked) {
                if let Some(old) = current.take() {
                    tracing::info!(plugin = %name, path = %old.path.display(), "our registration socket was removed; creating it again");
                    let _ = old.stop().await;
                    registered.send_replace(Registered::Waiting);
                    self.report(RegistrationEvent::Withdrawn);
                }
                let due = |at: Option<Instant>| at.is_none_or(|at| at <= Instant::now());
                if !folder_present {
                    if !folder_logged {
                        folder_logged = true;
                        tracing::info!(plugin = %name, dir = %self.path.parent().unwrap_or(Path::new(".")).display(), "waiting for the kubelet's plugin-watcher folder");
                    }
                } else if due(offer_at) && due(bind_at) {
                    folder_logged = false;
                    generation += 1;
                    if let Some(on_offer) = &self.on_offer {
                        on_offer();
                    }
                    match self.offer(generation, &notes_tx, &stop) {
                        Ok(served) => {
                            offer_at = None;
                            bind_at = None;
                            bind_backoff.reset();
                            tracing::info!(plugin = %name, path = %self.path.display(), "registration socket ready for the kubelet's plugin watcher");
                            current = Some(served);
                            self.report(RegistrationEvent::Offered);
                        }
                        Err(err) => {
                            let delay = bind_backoff.next_delay();
                            tracing::error!(plugin = %name, path = %self.path.display(), error = %bind_error(&err), retry_in = ?delay, "cannot bind the registration socket");
                            bind_at = Some(Instant::now() + delay);
                        }
                    }
                }
            }

            let wake_at = [bind_at, offer_at].into_iter().flatten().min();
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = sleep_until(wake_at.unwrap_or_else(far_future)), if wake_at.is_some() => {
                    let now = Instant::now();
                    bind_at = bind_at.filter(|at| *at > now);
                    offer_at = offer_at.filter(|at| *at > now);
                }
                note = notes.recv() => {
                    let Some(note) = note else { break };
                    if note.generation != generation {
                        continue;
                    }
                    if note.registered {
                        let again = accepted == Some(generation);
                        accepted = Some(generation);
                        refused_backoff.reset();
                        registered.send_replace(Registered::Yes);
                        self.report(RegistrationEvent::Registered { again });
                    } else {
                        let delay = refused_backoff.next_delay();
                        tracing::warn!(plugin = %name, error = %note.error, retry_in = ?delay, "the kubelet refused the registration; offering it again after a delay");
                        if let Some(old) = current.take() {
                            let _ = old.stop().await;
                        }
                        offer_at = Some(Instant::now() + delay);
                        registered.send_replace(Registered::Refused(note.error.clone()));
                        self.report(RegistrationEvent::Refused { error: note.error });
                    }
                }
                again = reoffers.recv() => {
                    if again.is_none() {
                        stop.cancelled().await;
                        break;
                    }
                    if let Some(old) = current.take() {
                        let _ = old.stop().await;
                        registered.send_replace(Registered::Waiting);
                    }
                }
                news = next_news(&mut self.folder, &mut self.events) => match news {
                    // The folder came or went: bind at once when it is there.
                    FolderNews::State => {
                        bind_at = None;
                        bind_backoff.reset();
                    }
                    FolderNews::Inside => {}
                    FolderNews::Ended => {
                        stop.cancelled().await;
                        break;
                    }
                },
            }
        }
        registered.send_replace(Registered::Waiting);
        match current.take() {
            Some(served) => served.stop().await,
            None => None,
        }
    }

    /// Binds and serves the socket, generation `generation`.
    fn offer(
        &self,
        generation: u64,
        notes: &mpsc::UnboundedSender<Note>,
        stop: &CancellationToken,
    ) -> std::io::Result<Served> {
        let service = RegistrationService {
            info: self.info.clone(),
            generation,
            notes: notes.clone(),
        };
        Served::start(
            &self.path,
            tonic::transport::Server::builder().add_service(RegistrationServer::new(service)),
            stop.child_token(),
            format!("the registration socket of {}", self.info.name),
        )
    }
}

/// The `pluginregistration.Registration` service of one registration socket.
struct RegistrationService {
    info: PluginInfo,
    generation: u64,
    notes: mpsc::UnboundedSender<Note>,
}

#[tonic::async_trait]
impl pr::registration_server::Registration for RegistrationService {
    async fn get_info(
        &self,
        _: tonic::Request<InfoRequest>,
    ) -> Result<tonic::Response<PluginInfo>, tonic::Status> {
        Ok(tonic::Response::new(self.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        request: tonic::Request<RegistrationStatus>,
    ) -> Result<tonic::Response<RegistrationStatusResponse>, tonic::Status> {
        let status = request.into_inner();
        let _ = self.notes.send(Note {
            generation: self.generation,
            registered: status.plugin_registered,
            error: status.error,
        });
        Ok(tonic::Response::new(RegistrationStatusResponse {}))
    }
}
