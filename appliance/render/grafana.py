"""Grafana's dashboard JSON model, the parts the appliance's dashboard uses: panels as plain data, laid out on
Grafana's 24-column grid, wrapped for import through Grafana's UI.

Import asks for the `__inputs` (here one Prometheus data source) and writes the chosen uid wherever
`${DS_PROMETHEUS}` stands, in every panel and annotation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

JSON = dict[str, Any]
DATASOURCE: JSON = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# What Grafana 10 and later write for a new dashboard; an older or newer Grafana migrates the model on import.
SCHEMA_VERSION = 39
GRID_WIDTH = 24


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str
    instant: bool = False  # stat, bar gauge and table panels show the last value only
    table: bool = False  # one row per series, its labels as columns


@dataclass(frozen=True)
class Threshold:
    """A line across a panel at `value`; `above_is_bad` colours the side past it."""

    value: float
    above_is_bad: bool = True

    def steps(self) -> list[JSON]:
        good, bad = ("green", "red") if self.above_is_bad else ("red", "green")
        return [{"color": good, "value": None}, {"color": bad, "value": self.value}]


@dataclass(frozen=True)
class Panel:
    kind: str  # Grafana's panel type
    title: str
    description: str
    targets: tuple[Target, ...]
    w: int
    h: int
    defaults: JSON  # fieldConfig.defaults
    options: JSON
    overrides: tuple[JSON, ...] = ()
    transformations: tuple[JSON, ...] = ()


def timeseries(
    title: str,
    description: str,
    unit: str,
    *found: Target,
    threshold: Threshold | None = None,
    overrides: tuple[JSON, ...] = (),
    bars: bool = False,
    w: int = 12,
) -> Panel:
    custom: JSON = {
        "drawStyle": "bars" if bars else "line",
        "lineWidth": 1,
        "fillOpacity": 40 if bars else 10,
        "showPoints": "never",
        "spanNulls": False,
    }
    defaults: JSON = {"unit": unit, "color": {"mode": "palette-classic"}, "custom": custom}
    if threshold is not None:
        custom["thresholdsStyle"] = {"mode": "line"}
        defaults["thresholds"] = {"mode": "absolute", "steps": threshold.steps()}
    options = {
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "none"},
    }
    return Panel("timeseries", title, description, found, w, 8, defaults, options, overrides)


def state(
    title: str, description: str, expr: str, meanings: dict[int, tuple[str, str]], w: int = 4, h: int = 4
) -> Panel:
    """A stat of a 0/1 gauge, each value shown as a word on its colour: {1: ("up", "green"), 0: ("down", "red")}."""
    mapping = {
        str(value): {"text": text, "color": color, "index": i}
        for i, (value, (text, color)) in enumerate(meanings.items())
    }
    defaults: JSON = {
        "unit": "none",
        "color": {"mode": "thresholds"},
        "thresholds": {"mode": "absolute", "steps": [{"color": "text", "value": None}]},
        "mappings": [{"type": "value", "options": mapping}],
    }
    options = {
        "colorMode": "background",
        "graphMode": "none",
        "justifyMode": "center",
        "textMode": "value",
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
    }
    return Panel("stat", title, description, (Target(expr, title, instant=True),), w, h, defaults, options)


def bars(title: str, description: str, target: Target, w: int) -> Panel:
    """A horizontal bar per series (a bar gauge): counts by a label, read at the end of the range."""
    defaults: JSON = {
        "unit": "none",
        "decimals": 0,
        "min": 0,
        "color": {"mode": "palette-classic"},
        "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}]},
    }
    options = {
        "orientation": "horizontal",
        "displayMode": "basic",
        "showUnfilled": True,
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
    }
    return Panel("bargauge", title, description, (target,), w, 8, defaults, options)


def table(title: str, description: str, target: Target, columns: dict[str, str], w: int) -> Panel:
    """One row per series of an info metric: the labels in `columns` (label -> header), nothing else."""
    organize = {"id": "organize", "options": {"renameByName": columns, "indexByName": {}, "excludeByName": {}}}
    keep = {"id": "filterFieldsByName", "options": {"include": {"names": list(columns)}}}
    defaults: JSON = {"custom": {"align": "auto"}}
    options = {"showHeader": True, "cellHeight": "sm"}
    return Panel("table", title, description, (target,), w, 8, defaults, options, (), (keep, organize))


def dashed(name_pattern: str, color: str | None = None) -> JSON:
    """Series whose name matches draw dashed (a baseline, a threshold), in `color` when given."""
    properties: list[JSON] = [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}]
    if color is not None:
        properties.append({"id": "color", "value": {"mode": "fixed", "fixedColor": color}})
    return {"matcher": {"id": "byRegexp", "options": name_pattern}, "properties": properties}


def layout(rows: list[tuple[str, list[Panel]]], min_step: str) -> list[JSON]:
    """Rows top to bottom, each row's panels left to right, wrapping at Grafana's 24 columns; ids in order."""
    laid: list[JSON] = []
    y = 0
    for title, panels in rows:
        laid.append({"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": _grid(0, y, 24, 1)})
        y += 1
        x, height = 0, 0
        for panel in panels:
            if x + panel.w > GRID_WIDTH:
                x, y, height = 0, y + height, 0
            laid.append(_panel(panel, _grid(x, y, panel.w, panel.h), min_step))
            x, height = x + panel.w, max(height, panel.h)
        y += height
    return [{"id": i, **panel} for i, panel in enumerate(laid, start=1)]


def _panel(p: Panel, grid: JSON, min_step: str) -> JSON:
    found: JSON = {
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": DATASOURCE,
        "gridPos": grid,
        "fieldConfig": {"defaults": p.defaults, "overrides": list(p.overrides)},
        "options": p.options,
        "targets": [_target(t, chr(ord("A") + i), min_step) for i, t in enumerate(p.targets)],
    }
    if p.transformations:
        found["transformations"] = list(p.transformations)
    return found


def _target(t: Target, ref: str, min_step: str) -> JSON:
    return {
        "datasource": DATASOURCE,
        "expr": t.expr,
        "legendFormat": t.legend,
        "refId": ref,
        # Grafana's "Min step": $__rate_interval is then at least four of these, whatever scrape interval the
        # data source itself was given.
        "interval": min_step,
        "instant": t.instant,
        "range": not t.instant,
        "format": "table" if t.table else "time_series",
    }


def _grid(x: int, y: int, w: int, h: int) -> JSON:
    return {"h": h, "w": w, "x": x, "y": y}


def envelope(title: str, uid: str, description: str, panels: list[JSON], annotations: list[JSON]) -> JSON:
    """The dashboard around its panels, with the data source input that import asks for."""
    kinds = sorted({p["type"] for p in panels} - {"row"})
    return {
        "__inputs": [
            {
                "name": "DS_PROMETHEUS",
                "label": "Prometheus",
                "description": "The Prometheus that scrapes the appliance (its rendered scrape.yml)",
                "type": "datasource",
                "pluginId": "prometheus",
                "pluginName": "Prometheus",
            }
        ],
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            *({"type": "panel", "id": kind, "name": kind, "version": ""} for kind in kinds),
        ],
        "annotations": {"list": annotations},
        "description": description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,  # a shared crosshair: a restart lines up with the decode rate and the memory
        "id": None,
        "links": [],
        "panels": panels,
        "refresh": "1m",
        "schemaVersion": SCHEMA_VERSION,
        "tags": ["llm-appliance", "llama.cpp"],
        "templating": {"list": []},
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": title,
        "uid": uid,
        "version": 1,
        "weekStart": "",
    }
