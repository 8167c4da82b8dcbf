"""A real two-node SLURM cluster on this machine, for tests (needs root; no systemd).

    with SlurmCluster() as cluster:
        job = cluster.sbatch("slurm/stem_1b.sbatch", "--nodes=2", env={...})
        cluster.wait_state(job, "COMPLETED")

Debian's slurm-wlm (22.05) and munge, started by hand: one munged, a slurmctld in its own
network namespace ("ctl") and two slurmd, each in its own network namespace ("node1",
"node2") joined by a bridge. Every daemon also gets its own UTS namespace (hostname
ctl/node1/node2) and mount namespace in which a private hosts file is bind-mounted over
/etc/hosts, so node names resolve inside the cluster while the machine's /etc is never
touched. Each node advertises 8 count-only GPUs (GRES without device files), so sbatch
scripts that ask for `--gpus-per-node=8` are scheduled as on a GPU cluster.

Nothing is installed here (`.ci/run` installs slurm-wlm and munge). Everything lives in a
fresh temp dir; `close()` (also run at exit and on SIGTERM/SIGINT) cancels jobs, kills every
process left in the namespaces, stops the daemons, deletes namespaces, veths and the bridge
and removes the temp dir. Leftovers of a harness that was SIGKILLed are removed by the next
one (names carry the owner's pid).

Run `python tests/support/slurm_cluster.py` to get a cluster in a shell (`exit` tears it down).
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")  # job states that are final
PREFIX = "stemslurm"  # netns names: stemslurm<pid>-<host>; bridge/veths: ssl<pid>...
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")


class ClusterError(RuntimeError):
    pass


def missing_tools() -> list[str]:
    return [t for t in DAEMONS + CLIENTS + ("ip", "nsenter", "unshare")
            if shutil.which(t) is None]


def _run(*cmd, check=True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if check and proc.returncode:
        raise ClusterError(f"{' '.join(map(str, cmd))} exited {proc.returncode}: "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat_line.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is gone too


def _netns_pids(name: str) -> list[int]:
    out = _run("ip", "netns", "pids", name, check=False).stdout
    return [int(p) for p in out.split()]


def _kill_netns(name: str) -> None:
    """SIGKILL every process in network namespace `name`, then delete it."""
    for _ in range(50):
        pids = _netns_pids(name)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    _run("ip", "netns", "del", name, check=False)


def remove_stale() -> None:
    """Remove what harnesses whose owner process is gone left behind (a SIGKILLed pytest):
    processes started from their temp dirs (munged), namespaces, bridges, temp dirs."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        m = re.search(rf"/{PREFIX}(\d+)-", cmd)
        if m and not _pid_alive(int(m.group(1))):
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
    for d in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        m = re.match(rf"^{PREFIX}(\d+)-", d.name)
        if m and not _pid_alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        m = re.match(rf"^({PREFIX}(\d+)-\S+)", line)
        if m and not _pid_alive(int(m.group(2))):
            _kill_netns(m.group(1))
    for line in _run("ip", "-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        m = re.match(r"^\d+:\s+(ssl(\d+)br)[:@]", line)
        if m and not _pid_alive(int(m.group(2))):
            _run("ip", "link", "del", m.group(1), check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.213.x.0/24 that no interface or route on this machine uses yet."""
    used = _run("ip", "-o", "-4", "addr", check=False).stdout + \
        _run("ip", "-4", "route", check=False).stdout
    start = os.getpid() % 250
    for i in range(250):
        net = ipaddress.ip_network(f"10.213.{(start + i) % 250 + 1}.0/24")
        if f"10.213.{net.network_address.packed[2]}." not in used:
            return net
    raise ClusterError("no free 10.213.x.0/24 subnet for the test cluster")


SLURM_CONF = """\
# Generated by tests/support/slurm_cluster.py: a throwaway two-node test cluster.
ClusterName=stemtest
SlurmctldHost=ctl({ctl_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire: a requeued job waits this long before it may start again (default 120 s).
AuthInfo=socket={munge_socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=600
KillWait=10
InactiveLimit=0
GresTypes=gpu
{nodes}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """A local two-node SLURM cluster; a context manager (see the module docstring)."""

    def __init__(self, nodes: int = 2, cpus_per_node: int = 1, gpus_per_node: int = 8,
                 start_timeout: float = 60):
        self.node_names = [f"node{i + 1}" for i in range(nodes)]
        self.cpus_per_node, self.gpus_per_node = cpus_per_node, gpus_per_node
        self.start_timeout = start_timeout
        self.tag = f"{os.getpid()}"
        self.root: Path | None = None
        self.env: dict[str, str] = {}
        self._procs: list[tuple[str, subprocess.Popen]] = []
        self._netns: list[str] = []
        self._bridge: str | None = None
        self._closed = False
        self._old_handlers: dict = {}

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "SlurmCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        if os.geteuid() != 0:
            raise ClusterError("the local SLURM cluster needs root (network namespaces)")
        missing = missing_tools()
        if missing:
            raise ClusterError(f"missing {', '.join(missing)}: install slurm-wlm and munge "
                               "(.ci/run does: apt-get install -y slurm-wlm munge)")
        remove_stale()
        atexit.register(self.close)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _on_signal(self, signum, frame):
        self.close()
        handler = self._old_handlers.get(signum)
        if callable(handler):
            handler(signum, frame)
        raise SystemExit(128 + signum)

    def _start(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{self.tag}-"))
        for sub in ("state", "run", "log", "munge",
                    *(f"spool/{name}" for name in self.node_names)):
            (self.root / sub).mkdir(mode=0o700, parents=True)
        net = _free_subnet()
        hosts = list(net.hosts())
        self.bridge_addr = str(hosts[253])
        self.addrs = {"ctl": str(hosts[0])}
        self.addrs.update({name: str(hosts[10 + i]) for i, name in enumerate(self.node_names)})

        # Network: a bridge (with an address here, so clients on this machine reach the
        # controller) and one namespace per daemon host, each linked by a veth pair.
        self._bridge = f"ssl{self.tag}br"
        _run("ip", "link", "add", self._bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.bridge_addr}/{net.prefixlen}", "dev", self._bridge)
        _run("ip", "link", "set", self._bridge, "up")
        for i, host in enumerate(self.addrs):
            ns, outer = self.netns(host), f"ssl{self.tag}v{i}"
            _run("ip", "netns", "add", ns)
            self._netns.append(ns)
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0",
                 "netns", ns)
            _run("ip", "link", "set", outer, "master", self._bridge)
            _run("ip", "link", "set", outer, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.addrs[host]}/{net.prefixlen}",
                 "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        (self.root / "hosts").write_text(
            "127.0.0.1 localhost\n" +
            "".join(f"{addr} {host}\n" for host, addr in self.addrs.items()))

        # munge: a fresh key, a private socket (slurm is told via AuthInfo).
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = self.root / "munge" / "munge.socket"
        self._spawn("munged", ["munged", "--foreground", "--force", f"--key-file={key}",
                               f"--socket={self.munge_socket}",
                               f"--pid-file={self.root / 'run' / 'munged.pid'}",
                               f"--log-file={self.root / 'log' / 'munged.log'}",
                               f"--seed-file={self.root / 'munge' / 'munged.seed'}"])
        self._wait(lambda: self.munge_socket.exists(), "munged to create its socket")

        nodes = "\n".join(
            f"NodeName={name} NodeAddr={self.addrs[name]} CPUs={self.cpus_per_node} "
            f"RealMemory=1000 Gres=gpu:{self.gpus_per_node} State=UNKNOWN"
            for name in self.node_names)
        conf = self.root / "slurm.conf"
        conf.write_text(SLURM_CONF.format(
            ctl_addr=self.addrs["ctl"], ctld_port=6817, slurmd_port=6818,
            munge_socket=self.munge_socket, root=self.root, nodes=nodes))
        # slurmd drops GPUs without device files and wants character devices: give it
        # copies of /dev/null (the jobs never open them; torch here is a CPU build).
        (self.root / "dev").mkdir()
        for i in range(self.gpus_per_node):
            os.mknod(self.root / "dev" / f"nvidia{i}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        (self.root / "gres.conf").write_text(
            f"AutoDetect=off\nName=gpu File={self.root}/dev/nvidia[0-{self.gpus_per_node - 1}]\n")
        self.env = {**os.environ, "SLURM_CONF": str(conf)}

        self._spawn("slurmctld", self._in_host("ctl", ["slurmctld", "-D", "-i"]))
        self._wait(lambda: (ping := self.run("scontrol", "ping", check=False)).returncode == 0
                   and "UP" in ping.stdout, "slurmctld to answer")
        for name in self.node_names:
            self._spawn(f"slurmd {name}", self._in_host(name, ["slurmd", "-D", "-N", name]))
        self._wait(self._nodes_idle, "both nodes to be idle in sinfo")

    def netns(self, host: str) -> str:
        """The network namespace of `host` (ctl, node1, ...): `ip netns pids` lists its processes."""
        return f"{PREFIX}{self.tag}-{host}"

    def _in_host(self, host: str, cmd: list[str]) -> list[str]:
        """`cmd` in `host`'s network namespace, with its own hostname and hosts file."""
        script = (f"hostname {host} && mount --bind {self.root / 'hosts'} /etc/hosts && "
                  f'exec "$@"')
        return ["nsenter", f"--net=/run/netns/{self.netns(host)}", "unshare", "--uts",
                "--mount", "--propagation", "private", "sh", "-c", script, host, *cmd]

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name.replace(' ', '-')}.stdout", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env or None,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self._procs.append((name, proc))

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            for name, proc in self._procs:
                if proc.poll() is not None:
                    raise ClusterError(f"{name} exited with {proc.returncode} while waiting for "
                                       f"{what}:\n{self.logs()}")
            if ready():
                return
            time.sleep(0.2)
        raise ClusterError(f"timed out waiting for {what}:\n{self.logs()}")

    def _nodes_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n) == "idle" for n in self.node_names)

    def logs(self, tail: int = 30) -> str:
        """The tail of every daemon's log, for failure messages."""
        if self.root is None:
            return ""
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            lines = f.read_text(errors="replace").splitlines()[-tail:]
            if lines:
                parts.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def close(self) -> None:
        """Cancel jobs, stop daemons, remove namespaces, bridge and files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        try:
            if self.env and any(n == "slurmctld" and p.poll() is None for n, p in self._procs):
                self.run("scancel", "--full", "--signal=KILL", "--user=root", check=False,
                         timeout=10)
        except (subprocess.SubprocessError, OSError):
            pass
        # Jobs' processes (slurmstepd, the job's tasks) live in the nodes' namespaces:
        # SIGKILL everything there, then the daemons outside.
        for ns in reversed(self._netns):
            _kill_netns(ns)
        for name, proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self._bridge:
            _run("ip", "link", "del", self._bridge, check=False)
        if self.root is not None and os.environ.get("STEM_SLURM_KEEP") != "1":
            shutil.rmtree(self.root, ignore_errors=True)
        try:
            atexit.unregister(self.close)
        except Exception:
            pass

    # ------------------------------------------------------------------ clients

    def run(self, *cmd, check=True, env=None, **kw) -> subprocess.CompletedProcess:
        """A SLURM client command (sbatch, scontrol, ...) against this cluster, in `env`
        (default: this process's environment); sbatch passes it on to the job."""
        env = {**(os.environ if env is None else env), "SLURM_CONF": self.env["SLURM_CONF"]}
        return _run(*cmd, check=check, env=env, **kw)

    def sbatch(self, *args, env=None, cwd=None) -> str:
        """Submit; returns the job id."""
        return self.run("sbatch", "--parsable", *args, env=env, cwd=cwd).stdout.strip()

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, NodeList, ...); {} if unknown."""
        out = self.run("scontrol", "show", "job", "--oneliner", job_id, check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: str, until, timeout: float, poll: float = 0.5) -> dict:
        """Poll the job until `until(info)` is true; raise with the cluster logs on timeout."""
        deadline = time.monotonic() + timeout
        info = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if until(info):
                return info
            time.sleep(poll)
        raise ClusterError(f"job {job_id} timed out after {timeout:.0f}s in state "
                           f"{info.get('JobState')}: {info}\n{self.logs()}")


def main() -> int:
    """Bring a cluster up and open a shell with SLURM_CONF set; tear down on exit."""
    with SlurmCluster() as cluster:
        print(f"cluster up: SLURM_CONF={cluster.env['SLURM_CONF']}; `exit` tears it down",
              flush=True)
        cmd = sys.argv[1:] or [os.environ.get("SHELL", "bash")]
        return subprocess.call(cmd, env=cluster.env)


if __name__ == "__main__":
    sys.exit(main())
