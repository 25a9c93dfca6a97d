"""Automated operations in ClickHouse: every repair ticket change (`repair_tickets`: tickets by
rule, node and cluster, time to repair) and each cluster's electricity by the hour
(`energy_prices`, from the scheduler's ENERGY requests), which `energy-by-job` and
`energy-by-tenant` join to the GPU samples and allocations. Record sinks."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fleetline.storage.scheduling_sink import TableDestination
from fleetline.storage.sinks import Sourced

REPAIR_TICKETS = "repair_tickets"
ENERGY_PRICES = "energy_prices"
SOURCE = ("source_partition", "source_offset", "source_topic")


class TicketTable(TableDestination):
    name = "repair-tickets"
    table = REPAIR_TICKETS
    columns = (
        "ts_ms",
        "ticket_id",
        "node_id",
        "cluster_id",
        "rule",
        "severity",
        "state",
        "seq",
        "opened_ms",
        "summary",
        "reason",
        "evidence",
        *SOURCE,
    )

    def rows(self, batch: Sequence[Sourced]) -> list[list[Any]]:
        out = []
        for item in batch:
            r = item.record
            out.append(
                [
                    r["updated_ms"],
                    r["ticket_id"],
                    r["node_id"],
                    r["cluster_id"],
                    r["rule"],
                    r["severity"],
                    r["state"],
                    r["seq"],
                    r["opened_ms"],
                    r["summary"],
                    r["reason"],
                    r["evidence_json"],
                    item.partition,
                    item.offset,
                    item.topic,
                ]
            )
        return out


class EnergyPriceTable(TableDestination):
    """The scheduler's request log, of which only ENERGY requests make rows: 24 per profile
    (its hourly prices; a profile's exact windows are the scheduler's, not priced here)."""

    name = "energy-prices"
    table = ENERGY_PRICES
    columns = ("ts_ms", "cluster_id", "hour", "price_per_kwh", "renewable_share", "pue", *SOURCE)

    def rows(self, batch: Sequence[Sourced]) -> list[list[Any]]:
        out = []
        for item in batch:
            r = item.record
            if r["kind"] != "ENERGY":
                continue
            # Validated by the scheduler's fold (a bad one is dead-lettered there); here a
            # profile that does not parse stores nothing rather than stopping the sink.
            try:
                profile = json.loads(r["spec_json"] or "{}")
                prices = [float(p) for p in profile["price_per_kwh"]]
                shares = [float(v) for v in profile.get("renewable_share") or [0.0] * 24]
                pue = float(profile.get("pue") or 0.0)
            except (ValueError, KeyError, TypeError):
                continue
            for hour, (price, share) in enumerate(zip(prices, shares, strict=False)):
                out.append(
                    [
                        r["ts"],
                        r["key"],
                        hour,
                        price,
                        share,
                        pue,
                        item.partition,
                        item.offset,
                        item.topic,
                    ]
                )
        return out
