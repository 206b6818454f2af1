"""The schema of a matrix data file (``matrices/<target>.yaml``), validated with pydantic.

A matrix says what one target (a runtime, an execution provider or a device SDK's compiler) accepts:
its ``ai.onnx`` (and other domains') opset range, the IR version, whether shapes must be static, which
weight/activation dtypes it takes, size limits, and the operators it supports with their constraints.
Every fact names its source by id (``source: ortdocs``); ``sources`` maps each id to the document, the
section, the version, the address and the date it was read. A fact that could not be sourced is not
written: it goes to ``gaps`` as a sentence instead (an absent op is then "unknown", not "unsupported",
unless ``ops_complete`` says the list is the whole of what the target takes).

Operator entries follow ONNX's versioning: an entry covers the op's *schema versions* ``since..until``
(the ``since_version`` of the op's definition that the model's opset selects, ``onnx.defs.get_schema``),
which is how ONNX Runtime registers its kernels. A document that lists an op without versions gives
``since: 1`` and no ``until`` (every version within the target's opset range).
"""

from __future__ import annotations

import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from onnxdeploy.contract_terms import CacheWrite

__all__ = [
    "SCHEMA_VERSION",
    "DtypeSupport",
    "Generated",
    "Limit",
    "Matrix",
    "OpEntry",
    "Source",
    "SourceClaim",
    "TargetDefaults",
    "TypeEmulation",
    "VersionRange",
]

SCHEMA_VERSION = 1
"""Version of this schema; a matrix file states the one it was written for."""

DtypeName = Literal["fp32", "fp16", "bf16", "int8", "uint8", "int4", "uint4", "int16", "int32", "int64", "bool", "fp8"]

LimitName = Literal[
    "max_tensor_bytes",
    "max_operand_bytes",
    "context_bytes",
    "max_dim",
    "max_rank",
    "max_context_len",
    "max_batch",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Source(_Strict):
    """Where a fact comes from: a document (or a program's own registry), its section, version, address, date."""

    doc: str = Field(description="Document title or file name, e.g. 'docs/OperatorKernels.md'.")
    section: str = Field(description="Section, table or heading the fact is in.")
    version: str = Field(description="Version of the product or document, e.g. 'onnxruntime 1.32.0'.")
    address: str = Field(description="URL, repository path at a commit, or the Python call that produced it.")
    read: datetime.date = Field(description="Date the source was read (YYYY-MM-DD).")
    note: str = Field("", description="Anything a reader should know about the source (e.g. the commit read).")


class VersionRange(_Strict):
    """An inclusive integer range with its source (opset or IR version)."""

    min: int = Field(1, ge=0, description="Lowest version accepted.")
    max: int = Field(ge=0, description="Highest version accepted.")
    source: str = Field(description="Source id (a key of the file's 'sources').")

    @model_validator(mode="after")
    def _ordered(self) -> VersionRange:
        if self.min > self.max:
            raise ValueError(f"min {self.min} is above max {self.max}")
        return self


class DtypeSupport(_Strict):
    """Whether the target takes a data type (weights or activations), with its source."""

    supported: bool | Literal["partial"] = Field(description="true, false, or 'partial' (see note).")
    source: str = Field(description="Source id.")
    note: str = Field("", description="Conditions: which ops, weights only, per-channel only, ...")


class Limit(_Strict):
    """A size limit of the target (largest tensor, operand, context, dim, ...)."""

    name: LimitName = Field(description="What is limited.")
    value: int = Field(ge=0, description="The largest value allowed (in ``unit``).")
    unit: Literal["bytes", "elements", "tokens", "dims", "count"] = Field(description="Unit of ``value``.")
    applies_to: str = Field(
        "",
        description="Which tensors or ops the limit is about, in the source's words; empty: every tensor. Checked "
        "through ``ops``/``tensors``; words alone cannot be matched, so such a limit is reported, not checked.",
    )
    ops: list[str] = Field(
        default_factory=list, description="Op types whose input and output tensors the limit is checked on."
    )
    tensors: list[str] = Field(
        default_factory=list, description="Tensor name patterns (fnmatch, e.g. 'attention_mask*') it is checked on."
    )
    source: str = Field(description="Source id.")
    note: str = Field("", description="Context of the limit (e.g. the issue that found it).")


class SourceClaim(_Strict):
    """What another source says about an entry when it disagrees with the entry's own source (kept, not deleted)."""

    source: str = Field(description="Source id.")
    claim: str = Field(description="What that source states, e.g. 'Not Supported' in an older op table.")


class OpEntry(_Strict):
    """One operator the target supports, for a range of the op's schema versions, with its constraints.

    Machine-checked constraints: ``types`` (allowed ONNX element types per type parameter; the node's
    inputs and outputs are bound to type parameters through ``inputs``/``outputs``, or through the op's
    ONNX schema when those are absent), ``dtypes`` (allowed element types of every input and output, for
    documents that list dtypes per op without type parameters), ``max_rank``, ``attributes`` (allowed
    values per attribute), ``rules`` (named shape rules, e.g. ``block_size_divides_axis``), ``opset_max`` (the
    highest model opset the entry holds at) and ``placement``
    (``cpu_fallback``: accepted but not run on the accelerator).
    ``constraints`` holds the rules stated in words that are not checked.
    """

    op: str = Field(description="Operator type, e.g. 'Add'.")
    domain: str = Field("ai.onnx", description="Operator domain ('ai.onnx' for the default domain).")
    since: int = Field(1, ge=1, description="Lowest op schema version covered.")
    until: int | None = Field(None, ge=1, description="Highest op schema version covered; null: no upper bound.")
    via: Literal["kernel", "function", "graph", "converter", "listed"] = Field(
        "listed",
        description="kernel: a registered kernel; function: expanded from the ONNX function body; graph: handled "
        "by the runtime's graph loader (ORT turns Constant nodes into initializers); converter: the SDK's ONNX "
        "importer maps it; listed: named by a support table.",
    )
    types: dict[str, list[str]] | None = Field(
        None, description="Type parameter -> allowed ONNX element types ('float', 'int64', ...)."
    )
    inputs: list[str] | None = Field(None, description="Type parameter (or fixed type) of each formal input.")
    outputs: list[str] | None = Field(None, description="Type parameter (or fixed type) of each formal output.")
    dtypes: list[str] | None = Field(None, description="Allowed element types of every tensor input/output.")
    max_rank: int | None = Field(None, ge=0, description="Largest rank of any input/output.")
    attributes: dict[str, list[int | float | str]] | None = Field(
        None, description="Attribute name -> the only values accepted."
    )
    rules: list[Literal["block_size_divides_axis", "constant_inputs", "per_tensor_zero_points"]] = Field(
        default_factory=list,
        description="Machine-checked rules beyond types and attribute values. block_size_divides_axis: a blocked "
        "DequantizeLinear (block_size > 0) is accepted only when its input's dim on `axis` is a multiple of "
        "block_size (no partial last block; OpenVINO's CPU plugin refuses one, probed). constant_inputs: every "
        "input after the first must be a constant (an initializer or a Constant node's output), as OpenVINO's "
        "CPU plugin compiles Unsqueeze-13's axes only so (probed). per_tensor_zero_points: every input whose "
        "formal name ends in 'zero_point' holds at most one element (ORT's CPU ConvInteger fails at run on a "
        "per-channel w_zero_point, probed).",
    )
    opset_max: int | None = Field(
        None,
        ge=1,
        description="Highest opset of the op's domain at which the entry holds (null: every opset that selects "
        "the schema version). A function body is expanded at the model's opset, so ORT refuses an inlined op at "
        "later opsets whose body ops it lacks there (Swish-24 at opset 25+, probed).",
    )
    placement: Literal["accelerator", "cpu_fallback"] = Field(
        "accelerator", description="cpu_fallback: accepted, but runs on the host CPU (no NPU lowering)."
    )
    constraints: list[str] = Field(default_factory=list, description="Rules stated in words (not machine-checked).")
    source: str = Field(description="Source id.")
    other_sources: list[SourceClaim] = Field(
        default_factory=list,
        description="Sources that say otherwise about this op (e.g. an older op table that lists it as not "
        "supported, where the SDK's own build converts it); the entry follows ``source``.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> OpEntry:
        if self.until is not None and self.until < self.since:
            raise ValueError(f"{self.op}: until {self.until} is below since {self.since}")
        return self

    def covers(self, domain: str, op: str, schema_version: int | None) -> bool:
        """Whether this entry is about ``domain::op`` at op schema version ``schema_version`` (None: any)."""
        if self.domain != domain or self.op != op:
            return False
        if schema_version is None:
            return True
        return self.since <= schema_version and (self.until is None or schema_version <= self.until)


class TypeEmulation(_Strict):
    """How the target runs an op on an element type none of its kernels for that op takes.

    ONNX Runtime's CPU EP, for one: a node with a float16 input that no CPU kernel takes gets Casts to float
    inserted around it and runs its float kernel (``InsertCastTransformer``). The node then only has to fit an
    entry with every ``dtype`` tensor read as ``computes_in``.
    """

    computes_in: str = Field(description="ONNX element type the op runs in instead, e.g. 'float'.")
    how: str = Field(description="What the target does, one line for the finding, e.g. 'ORT inserts Casts'.")
    source: str = Field(description="Source id.")


class Generated(_Strict):
    """How a generated matrix was made (so it can be regenerated and compared)."""

    by: str = Field(description="The command that regenerates the file.")
    on: datetime.date = Field(description="Date it was generated.")
    versions: dict[str, str] = Field(description="Package versions it was generated from.")


class TargetDefaults(_Strict):
    """Pass settings a target implies when the pipeline does not choose (the pipeline's own keys win)."""

    cache_write: CacheWrite | None = Field(
        None, description="static_kv/kv_layout cache_write for this target (null: scatter_elements)."
    )
    note: str = Field("", description="Why: the measurement or document behind the choice.")


class Matrix(_Strict):
    """One target's compatibility matrix (the whole data file)."""

    schema_version: Literal[1] = Field(description="Schema version of the file (onnxdeploy.matrices.schema).")
    target: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$", description="Target id; equals the file name stem.")
    name: str = Field(description="Human name of the target.")
    kind: Literal["runtime", "execution_provider", "compiler"] = Field(description="What the target is.")
    description: str = Field("", description="One paragraph: what runs the model and how.")
    product_version: str = Field(description="Version of the runtime or SDK the facts are about.")
    execution_provider: str | None = Field(None, description="ONNX Runtime EP name, for ORT targets.")
    ir_version: VersionRange | None = Field(None, description="ONNX IR versions accepted; null when unsourced.")
    opsets: dict[str, VersionRange] = Field(description="Domain ('ai.onnx', 'com.microsoft', ...) -> opset range.")
    static_shapes: Literal["required", "preferred", "not_required"] | None = Field(
        None, description="Whether every dim must be static; null when unsourced."
    )
    static_shapes_source: str | None = Field(None, description="Source id of ``static_shapes``.")
    dtypes: dict[DtypeName, DtypeSupport] = Field(default_factory=dict, description="Data type support.")
    limits: list[Limit] = Field(default_factory=list, description="Size limits.")
    ops_complete: bool = Field(
        description="true: an op not listed is unsupported (the source is the target's whole list); false: unknown."
    )
    ops: list[OpEntry] = Field(default_factory=list, description="Supported operators.")
    emulated_types: dict[str, TypeEmulation] = Field(
        default_factory=dict,
        description="ONNX element type ('float16') -> how the target runs an op whose entries do not take it "
        "(converted around the node, computed in another type); such a node is a warning, not an error.",
    )
    sources: dict[str, Source] = Field(min_length=1, description="Source id -> where the facts come from.")
    generated: Generated | None = Field(None, description="Set for generated files.")
    gaps: list[str] = Field(default_factory=list, description="What could not be sourced and is left out.")
    notes: list[str] = Field(default_factory=list, description="Anything else a user should know.")
    defaults: TargetDefaults = Field(
        default_factory=TargetDefaults, description="Pass settings the target implies (e.g. cache_write)."
    )

    @model_validator(mode="after")
    def _sources_exist(self) -> Matrix:
        refs: list[tuple[str, str]] = []
        if self.ir_version is not None:
            refs.append(("ir_version", self.ir_version.source))
        refs += [(f"opsets.{d}", r.source) for d, r in self.opsets.items()]
        refs += [(f"dtypes.{d}", s.source) for d, s in self.dtypes.items()]
        refs += [(f"limits[{i}]", lim.source) for i, lim in enumerate(self.limits)]
        refs += [(f"ops[{i}] ({e.op})", e.source) for i, e in enumerate(self.ops)]
        refs += [
            (f"ops[{i}] ({e.op}) other_sources", c.source) for i, e in enumerate(self.ops) for c in e.other_sources
        ]
        refs += [(f"emulated_types.{t}", e.source) for t, e in self.emulated_types.items()]
        if self.static_shapes is not None:
            if self.static_shapes_source is None:
                raise ValueError("static_shapes is set without static_shapes_source")
            refs.append(("static_shapes_source", self.static_shapes_source))
        missing = [f"{where}: '{ref}'" for where, ref in refs if ref not in self.sources]
        if missing:
            raise ValueError(f"unknown source id(s) (not in 'sources'): {', '.join(missing[:10])}")
        return self

    def ops_for(self, domain: str, op: str, schema_version: int | None = None) -> list[OpEntry]:
        """Return the entries about ``domain::op`` at op schema version ``schema_version`` (None: any)."""
        return [e for e in self.ops if e.covers(domain, op, schema_version)]

    def source_text(self, source_id: str) -> str:
        """Render a source for a finding: ``doc, section (version; address; read DATE)``."""
        s = self.sources[source_id]
        return f"{s.doc}, {s.section} ({s.version}; {s.address}; read {s.read.isoformat()})"
