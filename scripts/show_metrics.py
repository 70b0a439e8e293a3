"""Print an agent's Prometheus metrics (`make demo`): the non-zero samples of some families.

Usage: show_metrics.py URL [SAMPLE_NAME...], e.g.
`show_metrics.py http://127.0.0.1:9464/metrics dpu_agent_jobs_total` (no name: all).
"""

import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def main(url: str, names: list[str]) -> None:
    """Scrape `url` and print `name{labels} value` for the named families' non-zero samples."""
    with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310 - the agent's http URL
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.value and (not names or sample.name in names):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                name = f"{sample.name}{{{labels}}}" if labels else sample.name
                number = int(sample.value) if sample.value.is_integer() else sample.value
                print(f"  {name} {number}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
