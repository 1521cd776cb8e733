"""The wire contract, generated from proto/shuffledp/v1/shuffledp.proto by grpcio-tools (tests/test_proto_fresh.py
checks that it is current). The foundation floor: it imports nothing of the project, and every party speaks it.
"""
