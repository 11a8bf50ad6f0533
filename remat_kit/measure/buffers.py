"""XLA's buffer assignment as the backend serializes it (`memory_analysis()`'s
`serialized_buffer_assignment_proto`: XLA CPU gives one, an ahead-of-time TPU compile an
empty one): each value's allocated size, by the instruction that defines it.
The messages read are a subset of xla/service/hlo.proto (BufferAssignmentProto,
HloInstructionProto), their field numbers as XLA defines them.
Docs: docs/compare.md ("The audit").
"""

from __future__ import annotations

import functools

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_INT64, _STRING, _MESSAGE, _BOOL = 3, 9, 11, 8
_ONE, _MANY = 1, 3
# message -> (field, number, type, label, message type); unknown fields are skipped.
_MESSAGES = {
    "Location": [("instruction_id", 4, _INT64, _ONE, None),
                 ("shape_index", 3, _INT64, _MANY, None)],
    "LogicalBuffer": [("id", 1, _INT64, _ONE, None), ("size", 2, _INT64, _ONE, None),
                      ("defined_at", 3, _MESSAGE, _ONE, "Location")],
    "Assigned": [("logical_buffer_id", 1, _INT64, _ONE, None),
                 ("size", 3, _INT64, _ONE, None)],
    "Allocation": [("is_thread_local", 3, _BOOL, _ONE, None),
                   ("assigned", 9, _MESSAGE, _MANY, "Assigned")],
    "BufferAssignment": [("logical_buffers", 1, _MESSAGE, _MANY, "LogicalBuffer"),
                         ("buffer_allocations", 3, _MESSAGE, _MANY, "Allocation")],
    "Instruction": [("name", 1, _STRING, _ONE, None), ("id", 35, _INT64, _ONE, None)],
}


@functools.cache
def _classes() -> dict:
    """The message classes of `_MESSAGES`, built once in a pool of their own."""
    proto = descriptor_pb2.FileDescriptorProto(name="remat_kit_buffers.proto",
                                               package="remat_kit_buffers", syntax="proto3")
    for message, fields in _MESSAGES.items():
        found = proto.message_type.add(name=message)
        for name, number, kind, label, of in fields:
            field = found.field.add(name=name, number=number, type=kind, label=label)
            if of:
                field.type_name = f".remat_kit_buffers.{of}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {m: message_factory.GetMessageClass(
        pool.FindMessageTypeByName(f"remat_kit_buffers.{m}")) for m in _MESSAGES}


def instruction_ids(compiled, computation: str | None = None) -> dict[str, int] | None:
    """{instruction name: XLA's id} of a compile's optimized module (of its `computation`
    only, where named), from its runtime executable; None where there is none (a target
    compiled ahead of time)."""
    try:
        module = compiled.runtime_executable().hlo_modules()[0]
    except Exception:  # noqa: BLE001 - no runtime half, no ids
        return None
    cls = _classes()["Instruction"]
    out = {}
    for comp in module.computations():
        if computation is not None and comp.name != computation:
            continue
        for instr in comp.instructions():
            found = cls.FromString(instr.as_serialized_proto())
            out[found.name] = found.id
    return out


def sizes(serialized: bytes, ids: dict[str, int]) -> dict[tuple[str, tuple], int]:
    """{(instruction name, shape index): bytes of its buffer} for each value the
    serialized buffer assignment places in a buffer of the program (not a thread-local
    one); `ids` from `instruction_ids`, the shape index () for an array output."""
    found = _classes()["BufferAssignment"].FromString(serialized)
    names = {i: n for n, i in ids.items()}
    placed = {a.logical_buffer_id: a.size for alloc in found.buffer_allocations
              if not alloc.is_thread_local for a in alloc.assigned}
    out = {}
    for buffer in found.logical_buffers:
        name = names.get(buffer.defined_at.instruction_id)
        if name is not None and buffer.id in placed:
            out[(name, tuple(buffer.defined_at.shape_index))] = placed[buffer.id]
    return out


__all__ = ["instruction_ids", "sizes"]
