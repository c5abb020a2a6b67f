"""The fleet's commands: a fleet file checked, and rendered for hosts behind HAProxy or for Kubernetes; every
file written by the one writer once all of them rendered and passed their checks."""

from __future__ import annotations

import argparse
import sys

from appliance.cli.commands import EXIT_OK, checked_files
from appliance.render.apply import changes, write
from appliance.spec.problems import format_problems


def cmd_fleet_validate(args: argparse.Namespace) -> int:
    from appliance.fleet.load import load_fleet

    fleet = load_fleet(args.fleet).fleet
    print(f"{args.fleet}: valid ({len(fleet.hosts)} hosts; their specs are checked by `fleet render`)")
    return EXIT_OK


def cmd_fleet_render(args: argparse.Namespace) -> int:
    """Every host's tree, haproxy.cfg and Prometheus' files, checked, then written by the one writer."""
    from appliance.fleet.fleet_render import hosts, render_fleet
    from appliance.fleet.load import load_fleet

    fleet = load_fleet(args.fleet)
    members, warnings = hosts(fleet)
    if warnings:
        print(format_problems(warnings), file=sys.stderr)
    files = render_fleet(fleet, members)
    for member in members:  # each host's tree as its own `apply` would check it
        tree = f"hosts/{member.name}/"
        checked_files({path.removeprefix(tree): text for path, text in files.items() if path.startswith(tree)})
    found = changes(files, args.out)
    write(found, args.out)
    print(f"rendered {len(files)} files for {len(members)} hosts into {args.out} ({len(found)} changed)")
    return EXIT_OK


def cmd_k8s_render(args: argparse.Namespace) -> int:
    """The fleet as kustomize trees (DIR/plain, DIR/llmkube; or the one flavour asked for, into DIR), written by
    the one writer once every tree rendered."""
    from appliance.fleet.load import load_fleet
    from appliance.k8s.llmkube import losses_text
    from appliance.k8s.members import appliance_sets, kubernetes_of
    from appliance.k8s.tree import FLAVORS, render_tree

    fleet = load_fleet(args.fleet)
    kubernetes_of(fleet)
    members, warnings = appliance_sets(fleet)
    if warnings:
        print(format_problems(warnings), file=sys.stderr)
    flavors = [args.flavor] if args.flavor else list(FLAVORS)
    files = {
        (path if args.flavor else f"{flavor}/{path}"): text
        for flavor in flavors
        for path, text in render_tree(fleet, members, flavor).items()
    }
    found = changes(files, args.out)
    write(found, args.out)
    pods = sum(member.replicas for member in members)
    print(
        f"rendered {len(files)} files ({', '.join(flavors)}) for {len(members)} StatefulSets, {pods} pods, into "
        f"{args.out} ({len(found)} changed)"
    )
    if "llmkube" in flavors:
        print(losses_text(), end="", file=sys.stderr)
    return EXIT_OK
