"""Writes the inventory of the TensorFlow Text ops that a given tf-text wheel registers.

TF Serving links the tf-text ops of one version (TF Serving 2.20 embeds
tf-text 2.20.0); a SavedModel that uses an op it lacks, or a node attribute its
op definition lacks ("NodeDef mentions attr ... not in Op"), does not load.
The installed tf-text is newer, and its op libraries cannot be loaded into
this TensorFlow to ask them, so this reads the wheel's shared libraries: an op
is registered with `REGISTER_OP("Name").Attr("name: type")...`, whose strings
are in the library's read-only data.

For every op that the *installed* tf-text registers, the inventory records
whether the wheel's libraries name it and which of its attributes and
arguments they spell as `"name: ..."`:

    pip download --no-deps tensorflow-text==2.20.0 -d /tmp/tft
    python scripts/tf_text_op_inventory.py /tmp/tft/tensorflow_text-2.20.0-*.whl \\
        export/tf_text_ops_2.20.0.json

`tests/test_export.py` checks the serving graphs against the committed file.
"""

import argparse
import json
import re
import sys
import zipfile


def registered_ops():
    """`{name: OpDef}` of the ops that importing `tensorflow_text` adds to TensorFlow's registry."""
    from tensorflow.core.framework import op_def_pb2
    from tensorflow.python.client import pywrap_tf_session

    def all_ops():
        op_list = op_def_pb2.OpList()
        op_list.ParseFromString(pywrap_tf_session.TF_GetBuffer(pywrap_tf_session.TF_GetAllOpList()))
        return {op.name: op for op in op_list.op}

    before = all_ops()
    import tensorflow_text  # noqa: F401

    return {name: op for name, op in all_ops().items() if name not in before}


def inventory(wheel, ops):
    libraries = {}
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.endswith(".so") and "/python/" in name:
                libraries[name] = archive.read(name)
    found = {}
    for op_name, op in sorted(ops.items()):
        for library, data in libraries.items():
            if b"\x00" + op_name.encode() + b"\x00" not in data:
                continue
            names = (
                [a.name for a in op.attr] + [a.name for a in op.input_arg] + [a.name for a in op.output_arg]
            )
            spelled = sorted(n for n in names if re.search(rb"\x00" + re.escape(n.encode()) + rb": ", data))
            found[op_name] = {"library": library.rsplit("/", 1)[-1], "spelled": spelled}
            break
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", help="a tensorflow-text wheel (pip download --no-deps ...)")
    parser.add_argument("output", help="the JSON inventory to write")
    args = parser.parse_args(argv)
    version = re.search(r"tensorflow_text-([^-]+)-", args.wheel)
    result = {
        "tensorflow_text": version.group(1) if version else None,
        "source": "scripts/tf_text_op_inventory.py",
        "ops": inventory(args.wheel, registered_ops()),
    }
    with open(args.output, "w", encoding="utf-8") as file:
        json.dump(result, file, indent=1, sort_keys=True)
        file.write("\n")
    print(f"{len(result['ops'])} ops of tf-text {result['tensorflow_text']} -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
