//! The `v1beta1.DevicePlugin` gRPC service for one resource: it streams the backend's device
//! list and answers allocation questions. Bad requests get a gRPC error, never a crash.

use super::status::StatusCell;
use super::ResourceShared;
use crate::backend::{AllocateError, PreferenceRequest};
use devplug_proto::v1beta1 as pb;
use std::collections::HashSet;
use std::pin::Pin;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// One resource's DevicePlugin service, for one bound socket.
pub(crate) struct PluginService {
    pub(crate) shared: Arc<ResourceShared>,
    /// Ends every ListAndWatch stream of this socket (socket re-bound, resource removed, shutdown).
    pub(crate) stop: CancellationToken,
    pub(crate) status: StatusCell,
}

type ListStream = Pin<Box<dyn Stream<Item = Result<pb::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl pb::device_plugin_server::DevicePlugin for PluginService {
    async fn get_device_plugin_options(
        &self,
        _: Request<pb::Empty>,
    ) -> Result<Response<pb::DevicePluginOptions>, Status> {
        let options = self.shared.backend().options();
        Ok(Response::new(pb::DevicePluginOptions {
            pre_start_required: options.pre_start_required,
            get_preferred_allocation_available: options.preferred_allocation,
        }))
    }

    type ListAndWatchStream = ListStream;

    async fn list_and_watch(&self, _: Request<pb::Empty>) -> Result<Response<ListStream>, Status> {
        let mut devices = self.shared.devices.clone();
        let (tx, rx) = mpsc::channel(1);
        let stop = self.stop.clone();
        let resource = self.shared.resource.clone();
        let open = self.status.stream_opened(self.stop.clone());
        let counters = self.status.counters.clone();
        let status = self.status.clone();
        tokio::spawn(async move {
            let _open = open;
            let mut refused_last = false;
            loop {
                let message = devices.borrow_and_update().to_wire();
                match message {
                    Ok(message) => {
                        if refused_last {
                            tracing::info!(resource = %resource, "the device list fits the kubelet's limit again; sent");
                        }
                        refused_last = false;
                        status.set_list_error(None);
                        tokio::select! {
                            _ = stop.cancelled() => return,
                            sent = tx.send(Ok(message)) => match sent {
                                Ok(()) => counters.list_sent(),
                                Err(_) => return,
                            },
                        }
                    }
                    // Sending it would break the kubelet's stream; keep the previous list.
                    Err(err) if !refused_last => {
                        refused_last = true;
                        tracing::error!(resource = %resource, %err, "device list not sent");
                        status.set_list_error(Some(err.to_string()));
                    }
                    Err(_) => {}
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tx.closed() => return,
                    changed = devices.changed() => if changed.is_err() {
                        // The backend is gone; never end the stream on our own (the kubelet
                        // would drop the resource). Wait for shutdown or the client to leave.
                        tokio::select! {
                            _ = stop.cancelled() => {}
                            _ = tx.closed() => {}
                        }
                        return;
                    },
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<pb::PreferredAllocationRequest>,
    ) -> Result<Response<pb::PreferredAllocationResponse>, Status> {
        let container_responses = request
            .into_inner()
            .container_requests
            .iter()
            .map(|req| {
                let size = usize::try_from(req.allocation_size).unwrap_or(0);
                let question = PreferenceRequest {
                    available: &req.available_device_i_ds,
                    must_include: &req.must_include_device_i_ds,
                    size,
                };
                let answer = self.shared.backend().preferred(&question);
                pb::ContainerPreferredAllocationResponse {
                    device_i_ds: clean_preference(&question, answer),
                }
            })
            .collect();
        Ok(Response::new(pb::PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<pb::AllocateRequest>,
    ) -> Result<Response<pb::AllocateResponse>, Status> {
        let started = std::time::Instant::now();
        let answer = self.answer_allocate(request);
        self.status
            .counters
            .allocated(started.elapsed(), answer.is_ok());
        answer
    }

    async fn pre_start_container(
        &self,
        request: Request<pb::PreStartContainerRequest>,
    ) -> Result<Response<pb::PreStartContainerResponse>, Status> {
        let backend = self.shared.backend();
        if backend.options().pre_start_required {
            let ids = request.into_inner().devices_ids;
            backend
                .pre_start(&ids)
                .await
                .map_err(|err| Status::internal(format!("{}: {err}", self.shared.resource)))?;
        }
        Ok(Response::new(pb::PreStartContainerResponse {}))
    }
}

impl PluginService {
    /// Checks the ids and asks the backend, one response per container request, in order.
    fn answer_allocate(
        &self,
        request: Request<pb::AllocateRequest>,
    ) -> Result<Response<pb::AllocateResponse>, Status> {
        let requests = request.into_inner().container_requests;
        if requests.is_empty() {
            return Err(Status::invalid_argument(format!(
                "{}: the Allocate request has no container requests",
                self.shared.resource
            )));
        }
        let mut container_responses = Vec::with_capacity(requests.len());
        let backend = self.shared.backend();
        for req in &requests {
            self.check_ids(&req.devices_ids)?;
            let edits = backend.allocate(&req.devices_ids).map_err(|err| {
                let message = format!("{}: {err}", self.shared.resource);
                match err {
                    AllocateError::InvalidRequest(_) => Status::invalid_argument(message),
                    AllocateError::Failed(_) => Status::internal(message),
                }
            })?;
            container_responses.push(edits.into_wire());
        }
        Ok(Response::new(pb::AllocateResponse {
            container_responses,
        }))
    }

    /// Rejects unknown and repeated ids, naming the first few of each.
    fn check_ids(&self, ids: &[String]) -> Result<(), Status> {
        let list = self.shared.devices.borrow();
        let unknown: Vec<&str> = ids
            .iter()
            .filter(|id| list.get(id).is_none())
            .map(String::as_str)
            .collect();
        let mut seen = HashSet::with_capacity(ids.len());
        let repeated: Vec<&str> = ids
            .iter()
            .filter(|id| !seen.insert(id.as_str()))
            .map(String::as_str)
            .collect();
        let mut problems = Vec::new();
        if !unknown.is_empty() {
            problems.push(format!("unknown device ids {}", few(&unknown)));
        }
        if !repeated.is_empty() {
            problems.push(format!("repeated device ids {}", few(&repeated)));
        }
        if ids.is_empty() {
            problems.push("no device ids".to_owned());
        }
        if problems.is_empty() {
            return Ok(());
        }
        Err(Status::invalid_argument(format!(
            "{}: cannot allocate: {}",
            self.shared.resource,
            problems.join("; ")
        )))
    }
}

/// How many ids an error message names before it only counts the rest: a request with 10,000
/// bad ids gets a short message, not a 140 KB one.
const IDS_NAMED: usize = 5;

/// The first [`IDS_NAMED`] ids, quoted, and how many more there are. Long ids are cut too.
fn few(ids: &[&str]) -> String {
    const ID_CHARS: usize = 64;
    let named: Vec<String> = ids
        .iter()
        .take(IDS_NAMED)
        .map(|id| {
            if id.chars().count() > ID_CHARS {
                let cut: String = id.chars().take(ID_CHARS).collect();
                format!("{cut:?}…")
            } else {
                format!("{id:?}")
            }
        })
        .collect();
    let more = ids.len().saturating_sub(IDS_NAMED);
    if more == 0 {
        format!("[{}]", named.join(", "))
    } else {
        format!("[{}] and {more} more", named.join(", "))
    }
}

/// Makes any backend answer well-formed: must-include ids first, then only available ids, no
/// repeats, at most `size` ids (never fewer than the must-include ids).
fn clean_preference(question: &PreferenceRequest<'_>, answer: Vec<String>) -> Vec<String> {
    let available: HashSet<&str> = question.available.iter().map(String::as_str).collect();
    let limit = question.size.max(question.must_include.len());
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(limit);
    let must = question.must_include.iter().cloned();
    let rest = answer
        .into_iter()
        .filter(|id| available.contains(id.as_str()));
    for id in must.chain(rest) {
        if out.len() == limit {
            break;
        }
        if seen.insert(id.clone()) {
            out.push(id);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn error_messages_name_a_few_ids_and_count_the_rest() {
        let many: Vec<String> = (0..10_000).map(|i| format!("bad-{i}")).collect();
        let refs: Vec<&str> = many.iter().map(String::as_str).collect();
        let text = few(&refs);
        assert_eq!(
            text,
            "[\"bad-0\", \"bad-1\", \"bad-2\", \"bad-3\", \"bad-4\"] and 9995 more"
        );
        assert_eq!(few(&["a", "b"]), "[\"a\", \"b\"]");
        let long = "x".repeat(10_000);
        assert!(few(&[&long]).len() < 80);
    }

    #[test]
    fn preference_is_cleaned_up() {
        let available = ids(&["a", "b", "c"]);
        let must = ids(&["b"]);
        let q = PreferenceRequest {
            available: &available,
            must_include: &must,
            size: 2,
        };
        // Unknown, repeated and too many ids from a sloppy backend.
        let got = clean_preference(&q, ids(&["zz", "c", "c", "b", "a"]));
        assert_eq!(got, ids(&["b", "c"]));
    }
}
