//! The write plan: given the slices we want (the targets) and the slices the API server has
//! (the cache), which are kept as they are, which are replaced, which created and which
//! deleted; and the requests that carry the plan out.

use super::compare::normalized;
use k8s_openapi::api::resource::v1 as api;
use k8s_openapi::api::resource::v1::ResourceSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use std::collections::BTreeMap;

/// One planned write.
pub(super) enum Write {
    Replace(String, usize),
    Create(usize),
    Delete(String),
}

/// The requests of a plan, in their order: creates and replacements at once, then deletions
/// (the new generation is complete before anything of the old one goes; consumers use the
/// newest anyway).
pub(super) struct Requests {
    /// Slices to write: the name of the slice replaced, or `None` for a create.
    pub(super) puts: Vec<(Option<String>, ResourceSlice)>,
    /// Names of the slices to delete.
    pub(super) deletes: Vec<String>,
}

/// The owner of our slices: the Node `node` whose UID is `uid`.
pub(super) fn owner(node: &str, uid: &str) -> OwnerReference {
    OwnerReference {
        api_version: "v1".to_owned(),
        kind: "Node".to_owned(),
        name: node.to_owned(),
        uid: uid.to_owned(),
        controller: Some(true),
        block_owner_deletion: None,
    }
}

/// The writes that turn `cache` (our slices, by name) into `targets`: slices already right
/// are kept, others of our pool (the pool of `node`) are reused (replaced), missing ones
/// created, the rest deleted.
pub(super) fn plan(
    cache: &BTreeMap<String, ResourceSlice>,
    node: &str,
    targets: &[api::ResourceSliceSpec],
    owner: &OwnerReference,
) -> Vec<Write> {
    // Each slice read once, in the form targets have; `None` when its owner is wrong.
    let mut free: Vec<(&String, Option<api::ResourceSliceSpec>)> = cache
        .iter()
        .map(|(name, slice)| {
            let owned =
                slice.metadata.owner_references.as_deref() == Some(std::slice::from_ref(owner));
            (name, owned.then(|| normalized(&slice.spec)))
        })
        .collect();
    let mut missing = Vec::new();
    for (i, target) in targets.iter().enumerate() {
        match free
            .iter()
            .position(|(_, spec)| spec.as_ref() == Some(target))
        {
            Some(at) => {
                free.remove(at);
            }
            None => missing.push(i),
        }
    }
    // Pool names cannot change: only slices of our pool can be reused.
    let (mut reusable, others): (Vec<&String>, Vec<&String>) = free
        .into_iter()
        .map(|(name, _)| name)
        .partition(|name| cache.get(*name).is_some_and(|s| s.spec.pool.name == node));
    reusable.reverse();
    let mut writes: Vec<Write> = missing
        .into_iter()
        .map(|i| match reusable.pop() {
            Some(name) => Write::Replace(name.clone(), i),
            None => Write::Create(i),
        })
        .collect();
    writes.extend(
        reusable
            .into_iter()
            .chain(others)
            .map(|name| Write::Delete(name.clone())),
    );
    writes
}

/// The requests of `writes` (planned against `cache` for `targets`): a replaced slice keeps
/// its metadata, a created one is named from `generateName: <node>-<driver>-`; both are owned
/// by `owner`.
pub(super) fn requests(
    writes: Vec<Write>,
    cache: &BTreeMap<String, ResourceSlice>,
    targets: &[api::ResourceSliceSpec],
    owner: &OwnerReference,
    driver: &str,
    node: &str,
) -> Requests {
    let mut puts: Vec<(Option<String>, ResourceSlice)> = Vec::new();
    let mut deletes: Vec<String> = Vec::new();
    for write in writes {
        match write {
            Write::Replace(name, i) => {
                let Some(mut slice) = cache.get(&name).cloned() else {
                    continue;
                };
                slice.spec = targets.get(i).cloned().unwrap_or_default();
                slice.metadata.owner_references = Some(vec![owner.clone()]);
                puts.push((Some(name), slice));
            }
            Write::Create(i) => {
                let slice = ResourceSlice {
                    metadata: ObjectMeta {
                        generate_name: Some(format!("{node}-{driver}-")),
                        owner_references: Some(vec![owner.clone()]),
                        ..Default::default()
                    },
                    spec: targets.get(i).cloned().unwrap_or_default(),
                };
                puts.push((None, slice));
            }
            Write::Delete(name) => deletes.push(name),
        }
    }
    Requests { puts, deletes }
}
