"""The committed generated code must match proto/ (regenerate with scripts/gen_proto)."""

import subprocess
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

from shuffledp.v1 import shuffledp_pb2, shuffledp_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]


def test_generated_descriptor_matches_proto(tmp_path):
    out = tmp_path / "set.pb"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            f"--descriptor_set_out={out}",
            "shuffledp/v1/shuffledp.proto",
        ],
        check=True,
        cwd=ROOT,
    )
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    committed = descriptor_pb2.FileDescriptorProto.FromString(shuffledp_pb2.DESCRIPTOR.serialized_pb)
    _strip_json_names(fresh)  # protoc adds derived json_name fields to descriptor sets, not to generated code
    assert committed == fresh, "shuffledp/v1 is stale: run scripts/gen_proto"


def test_generated_stubs_cover_every_service_method():
    for service in shuffledp_pb2.DESCRIPTOR.services_by_name.values():
        stub = getattr(shuffledp_pb2_grpc, f"{service.name}Stub")
        servicer = getattr(shuffledp_pb2_grpc, f"{service.name}Servicer")
        for method in service.methods:
            assert hasattr(servicer, method.name), f"{service.name}.{method.name} missing: run scripts/gen_proto"
        assert stub is not None


def _strip_json_names(file_proto: descriptor_pb2.FileDescriptorProto) -> None:
    def strip(message):
        for field in message.field:
            field.ClearField("json_name")
        for nested in message.nested_type:
            strip(nested)

    for message in file_proto.message_type:
        strip(message)
