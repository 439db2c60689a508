#!/usr/bin/env python3
"""Splits a callgrind profile's instructions (Ir) by where they were spent.

    callgrind-split.py FILE

Prints one JSON object: the total of the profile (what its toggles collected), and the
inclusive cost of every call from outside a part into it, summed per part: the soft RDMA
provider (`nvmfd_rdma::soft`, the NIC's emulation), the block backends (`nvmfd_blockdev`).
A call inside a part (the part calling itself) is not counted again.
"""
import json
import re
import sys

PARTS = {
    "nic_emulation": re.compile(r"nvmfd_rdma::soft::"),
    "block_backend": re.compile(r"nvmfd_blockdev::"),
}


def main(path):
    names = {}
    fn = callee = None
    pending_call = False
    total = 0
    parts = {k: 0 for k in PARTS}

    def name_of(spec):
        # "(id) name" defines, "(id)" refers back; without compression the spec is the name.
        m = re.match(r"\((\d+)\)(?: (.*))?$", spec)
        if not m:
            return spec
        if m.group(2) is not None:
            names[m.group(1)] = m.group(2)
        return names.get(m.group(1), "?")

    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("fn="):
                fn = name_of(line[3:])
            elif line.startswith("cfn="):
                callee = name_of(line[4:])
            elif line.startswith("calls="):
                pending_call = True
            elif line and (line[0].isdigit() or line[0] in "+-*"):
                fields = line.split()
                cost = int(fields[1]) if len(fields) > 1 else 0
                if pending_call:
                    pending_call = False
                    for k, rx in PARTS.items():
                        if rx.search(callee or "") and not rx.search(fn or ""):
                            parts[k] += cost
                else:
                    total += cost
    print(json.dumps({"total": total, **parts}))


if __name__ == "__main__":
    main(sys.argv[1])
