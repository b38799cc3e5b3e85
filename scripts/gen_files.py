"""Regenerate the files derived from others, so they cannot drift from their source.

- ``docs/configuration.md``, between its ``BEGIN/END GENERATED`` markers: the table of every
  option (flag, environment names, config key, default, meaning), from the option table
  (``gpuagent.config.OPTIONS``: the options of ``Settings``' fields), and the command line's own
  flags (``--version``, ``--help``) from its parser.
- ``manifests/overlays/prometheus-operator/prometheusrule.yaml``: the Prometheus rule groups of
  ``manifests/monitoring/alerts.yaml`` wrapped in a Prometheus Operator ``PrometheusRule``.
- ``deploy/helm/gpuagent/files/alerts.yaml``: a copy of ``manifests/monitoring/alerts.yaml`` (Helm
  reads no file outside the chart), with a first line that says so.

With ``--check`` nothing is written; the exit status is 1 if a committed file differs from what
would be generated (the test suite runs this).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuagent.config import Settings  # noqa: E402
from gpuagent.config.cli import build_parser  # noqa: E402
from gpuagent.config.load import load_as  # noqa: E402
from gpuagent.config.option import Option, options_of  # noqa: E402

CONFIGURATION_MD = ROOT / "docs" / "configuration.md"
ALERTS = ROOT / "manifests" / "monitoring" / "alerts.yaml"
PROMETHEUS_RULE = ROOT / "manifests" / "overlays" / "prometheus-operator" / "prometheusrule.yaml"
CHART_ALERTS = ROOT / "deploy" / "helm" / "gpuagent" / "files" / "alerts.yaml"

BEGIN = "<!-- BEGIN GENERATED: options (scripts/gen-files) -->"
END = "<!-- END GENERATED: options -->"
_DEFAULT_RE = re.compile(r"\s*\(default (?P<value>[^()]*(?:\([^()]*\)[^()]*)*)\)")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _computed_defaults(kind: type[Settings]) -> dict[str, str]:
    """Each option's default as the agent resolves it with no flag, environment or file."""
    settings = load_as(kind, [], {}).as_dict()
    out: dict[str, str] = {}
    for name, value in settings.items():
        if value is None or value in ("", []):
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, list):
            text = ",".join(str(v) for v in value)
        elif isinstance(value, float) and value.is_integer():
            text = str(int(value))
        else:
            text = str(value)
        out[name] = text
    if "metrics_port" in settings:
        out["metrics_address"] = f"{settings.get('metrics_host', '')}:{settings['metrics_port']}"
    return out


def options_table(kind: type[Settings] = Settings) -> str:
    """The Markdown table of every option of ``kind``'s fields, in the option table's order."""
    options = options_of(kind)
    computed = _computed_defaults(kind)
    rows = [
        "| flag | environment | config key | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for opt in options:
        value = "[=true|false]" if opt.is_bool else f" {opt.metavar or 'VALUE'}"
        flags = "<br>".join(
            f"`{_cell(spelling + value)}`" for spelling in (f"--{opt.name}", *opt.aliases)
        )
        env = "<br>".join(f"`{name}`" for name in opt.env_names)
        key = f"`{opt.name}`" if opt.in_file else "—"
        meaning = opt.help
        match = _DEFAULT_RE.search(meaning)
        default: str | None
        if match:
            default = match.group("value")
            meaning = (meaning[: match.start()] + meaning[match.end() :]).strip()
        else:
            default = computed.get(opt.dest)
        if default is None:
            shown = "none"
        elif " " in default:
            shown = _cell(default)  # prose, e.g. "console on a TTY, else json"
        else:
            shown = f"`{_cell(default)}`"
        rows.append(f"| {flags} | {env} | {key} | {shown} | {_cell(meaning)} |")
    rows += [
        f"| {flags} | — | — | — | {_cell(meaning)} |" for flags, meaning in _parser_only(options)
    ]
    return "\n".join(rows) + "\n"


def _parser_only(options: tuple[Option[Any], ...]) -> list[tuple[str, str]]:
    """The command line's flags that are no setting (``--version``, ``--help``): spellings, help."""
    settings = {spelling for opt in options for spelling in (f"--{opt.name}", *opt.aliases)}
    return [
        ("<br>".join(f"`{s}`" for s in action.option_strings), str(action.help))
        for action in build_parser(options)._actions  # argparse has no public list of its actions
        if action.option_strings and not settings & set(action.option_strings)
    ]


def configuration_md(current: str) -> str:
    """``current`` with the text between the markers replaced by a fresh table."""
    start, end = current.find(BEGIN), current.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{CONFIGURATION_MD}: markers {BEGIN!r} ... {END!r} not found")
    return current[: start + len(BEGIN)] + "\n" + options_table() + current[end:]


class _Dumper(yaml.SafeDumper):
    """Block style, sequences indented under their key, multi-line strings as literal blocks."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _rule_groups(alerts: Path) -> list[Any]:
    if not alerts.exists():
        return []
    document = yaml.safe_load(alerts.read_text(encoding="utf-8")) or {}
    if document.get("kind") == "PrometheusRule":
        document = document.get("spec") or {}
    groups = document.get("groups")
    if not isinstance(groups, list):
        raise SystemExit(f"{alerts}: expected Prometheus rule groups ('groups:' list)")
    return groups


def prometheus_rule() -> str:
    """The PrometheusRule manifest for the overlay, from the alert rules file.

    A plain rules file (``groups:`` at the top) is indented under ``spec:`` as it is, so its
    comments and block scalars survive; the result is checked to load to the same groups.
    """
    source = ALERTS.relative_to(ROOT)
    header = f"# Generated by scripts/gen-files from {source}; edit that, not this.\n"
    head = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "gpuagent", "namespace": "kube-system"},
    }
    groups = _rule_groups(ALERTS)
    if ALERTS.exists():
        text = ALERTS.read_text(encoding="utf-8")
        document = yaml.safe_load(text) or {}
        if set(document) == {"groups"} and "\n---" not in text and not text.startswith("---"):
            body = "".join(
                f"  {line}" if line.strip() else line for line in text.splitlines(keepends=True)
            )
            out = header + yaml.dump(head, Dumper=_Dumper, sort_keys=False) + "spec:\n" + body
            if yaml.safe_load(out)["spec"]["groups"] == groups:
                return out
    else:
        header += f"# ({source} does not exist yet: no rules.)\n"
    rule = {**head, "spec": {"groups": groups}}
    return header + yaml.dump(rule, Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True)


def targets() -> dict[Path, str]:
    """Each generated file and the content it should have."""
    current = CONFIGURATION_MD.read_text(encoding="utf-8")
    return {
        CONFIGURATION_MD: configuration_md(current),
        PROMETHEUS_RULE: prometheus_rule(),
        CHART_ALERTS: chart_alerts(),
    }


def chart_alerts() -> str:
    """The alert rules file for the Helm chart's PrometheusRule: the source, as it is."""
    source = ALERTS.relative_to(ROOT)
    header = f"# Copied by scripts/gen-files from {source}; edit that, not this.\n"
    return header + ALERTS.read_text(encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    stale = []
    for path, content in targets().items():
        existing = path.read_text(encoding="utf-8") if path.exists() else None
        if existing == content:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.write_text(content, encoding="utf-8")
    if args.check and stale:
        names = ", ".join(str(p) for p in stale)
        print(f"gen-files: stale: {names}; run scripts/gen-files", file=sys.stderr)
        return 1
    print("gen-files: " + ("wrote " + ", ".join(map(str, stale)) if stale else "up to date"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
