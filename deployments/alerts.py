"""Install the nightly alert: a webhook notification block and the automation of automations.yaml that uses it.

    python deployments/alerts.py --webhook-url https://hooks.example.com/draftline   (against PREFECT_API_URL)

Rerunning it updates the block and replaces the automation, so it is safe to run on every deploy.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import yaml

AUTOMATIONS = Path(__file__).with_name("automations.yaml")
PLACEHOLDER = "WEBHOOK_BLOCK_ID"
BLOCK_NAME = "draftline-regression-webhook"


def save_webhook_block(url: str, name: str = BLOCK_NAME) -> str:
    """A Custom Webhook block that POSTs {"title": subject, "text": body}; returns its block document id."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    if not url.startswith(("http://", "https://")):
        raise SystemExit(f"--webhook-url {url!r} is not an http(s) URL; pass the URL your chat or pager gives you")
    block = CustomWebhookNotificationBlock(name=name, url=url, method="POST",
                                           json_data={"title": "{{subject}}", "text": "{{body}}"})
    return str(block.save(name, overwrite=True))


def automations_with(block_id: str, path: Path = AUTOMATIONS) -> list[dict]:
    """The automations of the YAML file with the webhook block id filled in."""
    data = yaml.safe_load(path.read_text())
    items = data["automations"] if isinstance(data, dict) else data
    for automation in items:
        for action in automation.get("actions", []):
            if action.get("block_document_id") == PLACEHOLDER:
                action["block_document_id"] = block_id
    return items


async def _replace(items: list[dict]) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.automations import AutomationCore

    ids = []
    async with get_client() as client:
        for item in items:
            automation = AutomationCore.model_validate(item)
            for old in await client.read_automations_by_name(automation.name):
                await client.delete_automation(old.id)
            ids.append(str(await client.create_automation(automation)))
    return ids


def install(webhook_url: str, block_name: str = BLOCK_NAME, path: Path = AUTOMATIONS) -> list[str]:
    """Save the block, then create the automations (replacing same-named ones); returns the automation ids."""
    return asyncio.run(_replace(automations_with(save_webhook_block(webhook_url, block_name), path)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--webhook-url", required=True, help="where notifications are POSTed")
    parser.add_argument("--block-name", default=BLOCK_NAME, help=f"notification block name (default {BLOCK_NAME})")
    args = parser.parse_args(argv)
    ids = install(args.webhook_url, args.block_name)
    print(f"automation(s) {', '.join(ids)} notify {args.webhook_url} on draftline.regression.detected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
