# shellcheck shell=bash disable=SC2034,SC2153,SC2154
# (SC2034, SC2153, SC2154: the scripts set what this file reads and read what it sets.)
# What tools/gpu-node/run and tools/gpu-node/run-dra share, sourced by both (not run by itself):
# the argument (--fake), the log and result helpers, the cleanup that leaves nothing behind and
# its reaper, the preflight checks, unpacking target/gpu-node/, the cgroups and the pod network,
# the fake driver, containerd's and the kubelet's configuration and start, stopping devplug, the
# pods' log files and how long two pods ran cuda-check at once.
#
# A script sources it after `cd` to the repository root and `repo=$PWD`, having set what is its
# own:
#   ME            its name under tools/gpu-node/ (messages, the marker, the reaper)
#   NODE_NAME     the node's name, and the name of its folder /var/tmp/$NODE_NAME (NODE), its
#                 cgroup (CG), its CNI network (NET), its loader entry (SECCOMP_CONF) and the
#                 file that marks $KUBELET_ROOT as its own (MARKER)
#   BRIDGE SUBNET its CNI bridge and subnet; KUBELET_PORT the kubelet's port
#   DAEMONS       the pids/ names the cleanup stops, in this order (an array)
#   LOGGED        the folders of $NODE the cleanup keeps in $OUT_DIR/$LOGS_TAR (an array)
#   SUMMARY_FILE  the summary's name in $OUT_DIR
#   CLEANUP_MPS   1: the cleanup also kills and looks for MPS daemons of the node (mps_pids)
#   LEFT_CHECKED  what the cleanup's "nothing left" line says it looked for
#   POD_SUFFIX    what follows a pod's name in its pod-logs folder ("-$NODE_NAME" for static
#                 pods, whose names the kubelet suffixes with the node's)
# then calls parse_args "$@" and reap_if_asked, and uses the rest as it needs it. Besides the
# names above it sets GN, IMAGE, RESOURCE, KUBELET_ROOT, FAKE_VERSION, OUT_DIR, FAKE,
# expected_exit, failures, POD_NET, FAKE_NVML, FAKE_ROOT, GPU_UUID, NVIDIA_SETTINGS and BARRIER.
# `shellcheck tools/gpu-node/run tools/gpu-node/run-dra` reads this file with each script
# (tools/gpu-node/.shellcheckrc).

NODE=/var/tmp/$NODE_NAME
CG=$NODE_NAME
NET=$NODE_NAME
SECCOMP_CONF=/etc/ld.so.conf.d/zz-$NODE_NAME.conf
GN=$repo/target/gpu-node
IMAGE=devplug.test/gpu-node:1
RESOURCE=nvidia.com/gpu
# The kubelet's root: its device-plugins folder is fixed at /var/lib/kubelet/device-plugins
# whatever --root-dir says, so the node uses that root, marked as ours by MARKER.
KUBELET_ROOT=/var/lib/kubelet
MARKER=$KUBELET_ROOT/.$NODE_NAME
FAKE_VERSION=570.86.15
OUT_DIR=${OUT:-$repo/target/gpu-node-logs}

parse_args() { # the script's arguments
    FAKE=0
    REAP_AFTER=""
    case "${1:-}" in
        --fake) FAKE=1 ;;
        --cleanup-after) REAP_AFTER=${2:?} ;; # the reaper (reap_if_asked), not for people
        "") ;;
        *) echo "usage: tools/gpu-node/$ME [--fake]" >&2; exit 2 ;;
    esac
    # cuda-check's exit in a pod that works: 3 ("no real GPU here") on the fake driver.
    expected_exit=0
    if [ "$FAKE" = 1 ]; then expected_exit=3; fi
}

# --- logging and results --------------------------------------------------------------------
T0=$(date +%s%N)
now_ms() { echo $(( ($(date +%s%N) - T0) / 1000000 )); }
say() { printf '[%6.1f s] %s\n' "$(awk -v t="$(now_ms)" 'BEGIN {print t / 1000}')" "$*"; }
SUMMARY=()
failures=0
result() { SUMMARY+=("$*"); say "RESULT $*"; }
die() { say "FAILED: $*"; result "$ME: FAILED: $*"; exit 1; }
final_result() { # the run's last line; its status is the script's exit status
    result "$ME: $( [ $failures = 0 ] && echo ok || echo "$failures FAILED") in $(( $(now_ms) / 1000 )) s ($( [ "$FAKE" = 1 ] && echo 'fake driver' || echo 'real driver'))"
    [ $failures = 0 ]
}

ipcmd() {
    if command -v ip >/dev/null 2>&1; then ip "$@"; else "$NODE/bin/busybox" ip "$@"; fi
}

# --- cleanup: everything the script made, idempotent ----------------------------------------
ours() { [ -f "$1" ] && tr '\0' ' ' 2>/dev/null < "/proc/$(cat "$1")/cmdline" | grep -qF "$NODE"; }
# MPS daemons devplug started for this node: their pipe folder is under ours.
mps_pids() {
    local p
    for p in /proc/[0-9]*; do
        tr '\0' '\n' 2>/dev/null < "$p/environ" | grep -q "^CUDA_MPS_PIPE_DIRECTORY=$NODE/" && echo "${p#/proc/}"
    done
}
kill_containers() { # every process in the node's cgroups and the shims of its containerd (found
    # by its socket in their command line), -9, three times over
    local procs pid p
    for _ in 1 2 3; do
        # shellcheck disable=SC2044,SC2013 # cgroup paths and PIDs are single words
        for procs in $(find /sys/fs/cgroup -path "*/$CG/*" -name cgroup.procs 2>/dev/null); do
            for pid in $(cat "$procs" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
        done
        for p in /proc/[0-9]*; do
            case "$(tr '\0' ' ' 2>/dev/null < "$p/cmdline")" in
                *containerd-shim-runc-v2*"$NODE"*) kill -9 "${p#/proc/}" 2>/dev/null ;;
            esac
        done
        sleep 0.2
    done
}
cleanup() {
    set +e
    trap - EXIT INT TERM
    local name alive f pid m l c p left
    [ -n "${REAPER:-}" ] && kill "$REAPER" 2>/dev/null
    if [ -d "$NODE" ]; then
        if [ -d "$NODE/logs" ]; then
            mkdir -p "$OUT_DIR"
            tar -C "$NODE" -cJf "$OUT_DIR/$LOGS_TAR" "${LOGGED[@]}" 2>/dev/null
        fi
        for name in "${DAEMONS[@]}"; do
            ours "$NODE/pids/$name" && kill "$(cat "$NODE/pids/$name")" 2>/dev/null
        done
        for _ in $(seq 20); do
            alive=""
            for f in "$NODE"/pids/*; do ours "$f" && alive=1; done
            [ -z "$alive" ] && break
            sleep 0.25
        done
        for f in "$NODE"/pids/*; do ours "$f" && kill -9 "$(cat "$f")" 2>/dev/null; rm -f "$f"; done
        if [ "$CLEANUP_MPS" = 1 ]; then
            for pid in $(mps_pids); do kill -9 "$pid" 2>/dev/null; done
        fi
        kill_containers
        awk '{print $5}' /proc/self/mountinfo | grep -E "^($NODE|$KUBELET_ROOT)(/|$)" | sort -r | while read -r m; do
            umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null
        done
    fi
    [ -f "$MARKER" ] && rm -rf "$KUBELET_ROOT"
    ipcmd link delete "$BRIDGE" 2>/dev/null
    ipcmd link delete devplugprobe0 2>/dev/null
    ipcmd link delete devplugprobe1 2>/dev/null
    rm -rf "/var/lib/cni/networks/$NET" /var/lib/cni/results/"$NET"-* 2>/dev/null
    for _ in 1 2 3; do
        find /sys/fs/cgroup -depth -type d -path "*/$CG*" 2>/dev/null | while read -r c; do rmdir "$c" 2>/dev/null; done
        find /sys/fs/cgroup -type d -path "*/$CG*" 2>/dev/null | grep -q . || break
        sleep 0.3
    done
    find /var/log/containers /var/log/pods -maxdepth 1 2>/dev/null | while read -r l; do
        case "$(readlink "$l")" in "$NODE"/*) rm -f "$l" ;; esac
    done
    if [ -f "$SECCOMP_CONF" ]; then rm -f "$SECCOMP_CONF"; ldconfig 2>/dev/null; fi
    rm -rf "$NODE"
    # What is left, if anything.
    left=""
    for p in /proc/[0-9]*; do
        tr '\0' ' ' 2>/dev/null < "$p/cmdline" | grep -qF "$NODE" && [ "${p#/proc/}" != $$ ] && left="$left process ${p#/proc/}"
    done
    [ "$CLEANUP_MPS" = 1 ] && [ -n "$(mps_pids)" ] && left="$left mps-daemon"
    grep -qE " ($NODE|$KUBELET_ROOT)(/| )" /proc/self/mountinfo && left="$left mounts"
    [ -f "$MARKER" ] && left="$left $KUBELET_ROOT"
    find /sys/fs/cgroup -type d -path "*/$CG*" 2>/dev/null | grep -q . && left="$left cgroups"
    ipcmd link show "$BRIDGE" >/dev/null 2>&1 && left="$left bridge"
    [ -e "$NODE" ] && left="$left folder"
    if [ -n "${CLEANUP_REPORT:-}" ]; then
        if [ -z "$left" ]; then
            result "cleanup: nothing left ($LEFT_CHECKED)"
        else
            result "cleanup: LEFT BEHIND:$left"
        fi
        {
            echo "gpu-node $ME ($( [ "$FAKE" = 1 ] && echo 'fake driver rehearsal' || echo 'real driver'), $(date -u +%FT%TZ))"
            printf '%s\n' "${SUMMARY[@]}"
        } > "$OUT_DIR/$SUMMARY_FILE" 2>/dev/null
        echo "== summary"
        printf '  %s\n' "${SUMMARY[@]}"
        echo "logs: $OUT_DIR/$LOGS_TAR"
    fi
    [ -z "$left" ]
}

# The reaper: a process in a session of its own that waits for the run to end and cleans up
# after it, for a run killed with SIGKILL (as a time limit does) that could not.
reap_if_asked() {
    [ -n "$REAP_AFTER" ] || return 0
    while kill -0 "$REAP_AFTER" 2>/dev/null; do sleep 0.5; done
    cleanup >/dev/null 2>&1
    exit 0
}

# --- preflight ------------------------------------------------------------------------------
preflight_node() { # what to add to the message when a file of target/gpu-node is missing
    [ "$(id -u)" = 0 ] || { echo "run as root (a kubelet, containerd and runc)" >&2; exit 1; }
    local f
    for f in kubelet.xz containerd.xz containerd-shim-runc-v2.xz ctr.xz node.tar.xz devplug.xz image.oci.tar.xz busybox SHA256SUMS; do
        [ -f "$GN/$f" ] || { echo "missing $GN/$f: run tools/gpu-node/prepare first${1:+ $1}" >&2; exit 1; }
    done
}
preflight_host() { # the fake NVML (--fake), and a kubelet root that is not someone else's
    if [ "$FAKE" = 1 ]; then
        FAKE_NVML=$repo/target/debug/libfake_nvml.so
        [ -f "$FAKE_NVML" ] || { echo "missing $FAKE_NVML: cargo build -p fake-nvml" >&2; exit 1; }
    fi
    if [ -e "$KUBELET_ROOT" ] && [ ! -f "$MARKER" ]; then
        echo "$KUBELET_ROOT exists and is not this script's: a kubelet (or devplug's whole-node tests) uses this machine; not touching it" >&2
        exit 1
    fi
}
begin() { # the folders to make under $NODE: the cleanup armed (trap and reaper), the folders
    # and the marker made, target/gpu-node checked
    # A run killed before its cleanup left its things: remove them first.
    cleanup >/dev/null 2>&1
    CLEANUP_REPORT=1
    trap 'cleanup' EXIT
    trap 'result "$ME: INTERRUPTED (signal)"; exit 130' INT TERM
    setsid bash "$repo/tools/gpu-node/$ME" --cleanup-after $$ > /dev/null 2>&1 < /dev/null &
    REAPER=$!
    mkdir -p "${@/#/$NODE/}" "$KUBELET_ROOT" "$OUT_DIR"
    echo "made by devplug's tools/gpu-node/$ME; removed by its cleanup" > "$MARKER"
    (cd "$GN" && sha256sum --quiet -c SHA256SUMS) || die "target/gpu-node does not match its SHA256SUMS"
}
say_machine() {
    local glibc
    glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
    say "machine: $(uname -srm), glibc ${glibc:-unknown}, $(nproc) CPUs"
}

# --- unpack ---------------------------------------------------------------------------------
unxz_to() { # archive, file: the machine's xz, else the carried busybox's
    if command -v xz >/dev/null 2>&1; then xz -dc "$1" > "$2"; else "$NODE/bin/busybox" xzcat "$1" > "$2"; fi
}
unpack() { # what the timing line calls them, then a folder of more NAME.xz and their names
    # (run-dra: the control plane's): the binaries into $NODE/bin, node.tar.xz into $NODE, the
    # image beside it; libseccomp on the loader's path if the machine lacks it; PATH
    local what=$1 t b from=""
    shift
    [ $# -gt 0 ] && { from=$1; shift; }
    t=$(now_ms)
    { cp "$GN/busybox" "$NODE/bin/busybox" && chmod 755 "$NODE/bin/busybox"; } || die "copying busybox"
    for b in kubelet containerd containerd-shim-runc-v2 ctr devplug; do
        { unxz_to "$GN/$b.xz" "$NODE/bin/$b" && chmod 755 "$NODE/bin/$b"; } || die "unpacking $b"
    done
    for b in "$@"; do
        { unxz_to "$from/$b.xz" "$NODE/bin/$b" && chmod 755 "$NODE/bin/$b"; } || die "unpacking $b"
    done
    { unxz_to "$GN/node.tar.xz" "$NODE/node.tar" && "$NODE/bin/busybox" tar -C "$NODE" -xf "$NODE/node.tar" \
        && rm -f "$NODE/node.tar"; } || die "unpacking node.tar.xz"
    unxz_to "$GN/image.oci.tar.xz" "$NODE/image.oci.tar" || die "unpacking the image"
    say "unpacked $what in $(( $(now_ms) - t )) ms"
    if ldd "$NODE/bin/runc" 2>/dev/null | grep -q 'libseccomp.so.2 => not found'; then
        # runc re-executes itself for `runc init` with a clean environment: the library must be
        # where the loader looks, so its folder is added to the loader's configuration until the
        # cleanup.
        echo "$NODE/lib" > "$SECCOMP_CONF" && ldconfig
        say "libseccomp.so.2 missing here: the carried one is on the loader's path until the cleanup"
    fi
    export PATH="$NODE/bin:$PATH"
}

# --- cgroups and network --------------------------------------------------------------------
make_cgroups() { # $CG in every cgroup hierarchy; on cgroup v2 the controllers the kubelet needs
    # Every cgroup hierarchy's mount point (v1: one per controller; v2: one).
    awk '{for (i = 7; i <= NF; i++) if ($i == "-") { if ($(i + 1) ~ /^cgroup2?$/) print $5; break }}' \
        /proc/self/mountinfo | while read -r root; do mkdir -p "$root/$CG"; done
    if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
        # cgroup v2: the controllers the kubelet needs, enabled for its root and below.
        local c
        for c in cpuset cpu io memory hugetlb pids; do
            echo "+$c" > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null
            echo "+$c" > "/sys/fs/cgroup/$CG/cgroup.subtree_control" 2>/dev/null
        done
    fi
}
pod_network() { # POD_NET: cni (the bridge of $NODE/cni), or host where the kernel makes no bridge
    POD_NET=cni
    # The CNI bridge plugin needs bridges and veth pairs from the kernel.
    if ipcmd link add devplugprobe0 type bridge 2>/dev/null \
        && ipcmd link add devplugprobe1 type veth peer name devplugprobe2 2>/dev/null; then
        ipcmd link delete devplugprobe0 2>/dev/null
        ipcmd link delete devplugprobe1 2>/dev/null
        cat > "$NODE/cni/10-$NET.conflist" <<EOF
{"cniVersion":"1.0.0","name":"$NET","plugins":[{"type":"bridge","bridge":"$BRIDGE","isGateway":true,"ipMasq":false,"ipam":{"type":"host-local","ranges":[[{"subnet":"$SUBNET"}]]}},{"type":"loopback"}]}
EOF
    else
        ipcmd link delete devplugprobe0 2>/dev/null
        POD_NET=host
        say "this kernel makes no bridge: the pods run on the host network (no CNI)"
    fi
}

# --- the fake driver ------------------------------------------------------------------------
fake_driver() { # the fake NVML with one fake H100 in a driver root of its own ($FAKE_ROOT), a
    # libcuda the loader refuses, an nvidia-smi that lists the GPU, and device nodes (mknod);
    # NVIDIA_SETTINGS: the devplug settings that point at them
    FAKE_ROOT=$NODE/gpu/driver-root
    local lib=$FAKE_ROOT/usr/lib/x86_64-linux-gnu
    mkdir -p "$lib" "$FAKE_ROOT/usr/bin" "$NODE/gpu/dev"
    cp "$FAKE_NVML" "$lib/libnvidia-ml.so.$FAKE_VERSION"
    ln -s "libnvidia-ml.so.$FAKE_VERSION" "$lib/libnvidia-ml.so.1"
    GPU_UUID=GPU-10000000-0000-4000-8000-000000000000
    cat > "$lib/fake-nvml.yaml" <<EOF
control: gpu-node.control
gpus:
  - uuid: $GPU_UUID
    name: NVIDIA H100 80GB HBM3 (fake)
    memory_mib: 81559
    bus_id: "00000000:00:05.0"
    compute_capability: "9.0"
    numa: 0
EOF
    # Not an ELF file: the pods' dynamic loader refuses it, as on a node without a GPU.
    echo "fake libcuda of the gpu-node rehearsal" > "$lib/libcuda.so.$FAKE_VERSION"
    ln -s "libcuda.so.$FAKE_VERSION" "$lib/libcuda.so.1"
    printf '#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (fake) (UUID: %s)"\n' "$GPU_UUID" > "$FAKE_ROOT/usr/bin/nvidia-smi"
    chmod 755 "$FAKE_ROOT/usr/bin/nvidia-smi"
    local n
    for n in nvidia0 nvidiactl nvidia-uvm; do mknod "$NODE/gpu/dev/$n" c 1 3; done
    NVIDIA_SETTINGS="driver_roots: [$FAKE_ROOT]
      dev_root: $NODE/gpu/dev"
}

# --- containerd -----------------------------------------------------------------------------
containerd_config() { # lines to add to the CRI plugin's own settings (run-dra: CDI), if any
    {
        cat <<EOF
version = 2
root = "$NODE/containerd/root"
state = "$NODE/containerd/state"
[grpc]
  address = "$NODE/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$IMAGE"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
EOF
        [ -z "${1:-}" ] || printf '%s\n' "$1"
        cat <<EOF
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
    SystemdCgroup = false
    Root = "$NODE/containerd/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$NODE/bin"
    conf_dir = "$NODE/cni"
EOF
    } > "$NODE/containerd.toml"
}
spawn() { # name, then the command; logs to logs/<name>.log, PID in pids/<name>
    local name=$1; shift
    setsid "$@" >> "$NODE/logs/$name.log" 2>&1 < /dev/null &
    echo $! > "$NODE/pids/$name"
}
ctr() { "$NODE/bin/ctr" --address "$NODE/containerd.sock" --namespace k8s.io "$@"; }
wait_for() { # seconds, what is awaited (for the reader), then a test command
    local limit=$1; shift 2
    local until=$(( $(date +%s) + limit ))
    while ! "$@" >/dev/null 2>&1; do
        [ "$(date +%s)" -lt "$until" ] || return 1
        sleep 0.1
    done
}
start_containerd() {
    spawn containerd "$NODE/bin/containerd" --config "$NODE/containerd.toml"
    wait_for 30 containerd ctr version || die "containerd did not answer in 30 s (logs/containerd.log)"
}
import_image() {
    ctr images import --all-platforms "$NODE/image.oci.tar" > "$NODE/logs/ctr-import.log" 2>&1 \
        || die "ctr images import: $(tail -n 3 "$NODE/logs/ctr-import.log")"
}

# --- kubelet --------------------------------------------------------------------------------
kubelet_config() { # lines after `kind:` (run: the static pods' folder), lines before
    # syncFrequency (run-dra: the node status' frequency); either may be empty
    {
        cat <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
EOF
        [ -z "$1" ] || printf '%s\n' "$1"
        cat <<EOF
cgroupDriver: cgroupfs
cgroupRoot: /$CG
failSwapOn: false
failCgroupV1: false
evictionHard: {}
localStorageCapacityIsolation: false
address: 127.0.0.1
port: $KUBELET_PORT
healthzPort: 0
readOnlyPort: 0
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
resolvConf: ""
podLogsDir: $NODE/pod-logs
containerRuntimeEndpoint: unix://$NODE/containerd.sock
EOF
        [ -z "$2" ] || printf '%s\n' "$2"
        echo "syncFrequency: 5s"
    } > "$NODE/kubelet.yaml"
}
start_kubelet() { # more flags (run-dra: --kubeconfig)
    spawn kubelet "$NODE/bin/kubelet" --config "$NODE/kubelet.yaml" "$@" --root-dir "$KUBELET_ROOT" \
        --cert-dir "$NODE/kubelet-certs" --hostname-override "$NODE_NAME" --node-ip 127.0.0.1
}

# --- devplug --------------------------------------------------------------------------------
stop_devplug() {
    local pid
    pid=$(cat "$NODE/pids/devplug")
    kill "$pid" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    kill -9 "$pid" 2>/dev/null
    rm -f "$NODE/pids/devplug"
}

# --- pods -----------------------------------------------------------------------------------
pod_log_file() { # pod, and the container's restart count (0 unless given): its log in the
    # kubelet's pod log folder
    # shellcheck disable=SC2012 # the kubelet's own folder names
    ls "$NODE/pod-logs/default_$1${POD_SUFFIX}_"*/cuda/"${2:-0}".log 2>/dev/null | head -n 1
}
pod_text() { # pod: the container's output, without the CRI prefix
    local f
    f=$(pod_log_file "$1")
    [ -n "$f" ] && cut -d' ' -f4- "$f"
}
# Run by the pods (/barrier is the node's barrier/ folder): each waits (10 s at most) until both
# pods of a pair are in, so that both hold a CUDA context at once.
# shellcheck disable=SC2016 # expanded by the pod's shell
BARRIER='touch /barrier/$(hostname); n=0; while [ $(ls /barrier | wc -l) -lt 2 ] && [ $n -lt 100 ]; do sleep 0.1; n=$((n + 1)); done; echo "barrier: $(ls /barrier | wc -l) pods in after $n waits"'
# When a pod's cuda-check ran: the CRI log's own timestamps of its first line and of its first
# exit line.
span() { # pod: start and end of its first cuda-check in ns since the epoch
    local f
    f=$(pod_log_file "$1")
    [ -n "$f" ] || return 1
    echo "$(date -d "$(grep -m1 ' cuda-check: ' "$f" | cut -d' ' -f1)" +%s%N) $(date -d "$(grep -m1 ' cuda-check exit ' "$f" | cut -d' ' -f1)" +%s%N)"
}
overlap() { # scenario, pod, pod: how long the two pods ran cuda-check at once, if they ran it
    local s1 s2 a1 b1 a2 b2 lo hi
    if s1=$(span "$2") && s2=$(span "$3"); then
        read -r a1 b1 <<< "$s1"; read -r a2 b2 <<< "$s2"
        lo=$(( a1 > a2 ? a1 : a2 )); hi=$(( b1 < b2 ? b1 : b2 ))
        say "$1 $2 ran cuda-check for $(( (b1 - a1) / 1000000 )) ms, $3 for $(( (b2 - a2) / 1000000 )) ms"
        if [ "$hi" -gt "$lo" ]; then
            result "$1 both pods ran cuda-check on the GPU at once for $(( (hi - lo) / 1000000 )) ms"
        else
            result "$1 the pods' cuda-check runs did not overlap (gap $(( (lo - hi) / 1000000 )) ms)"
        fi
    fi
}
