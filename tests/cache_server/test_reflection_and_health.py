"""Generic gRPC clients work: server reflection describes the services, the standard health service answers."""

from __future__ import annotations

import grpc
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase


def test_a_reflection_only_client_lists_and_describes_the_services(cache_server) -> None:
    with grpc.insecure_channel(cache_server.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"kvstash.v1.KVCache", "kvstash.v1.Admin", "grpc.health.v1.Health"} <= services
        # The descriptors come from the server alone: a private pool, nothing generated imported.
        pool = DescriptorPool(database)
        kv_cache = pool.FindServiceByName("kvstash.v1.KVCache")
        assert [method.name for method in kv_cache.methods] == [
            "Put",
            "Get",
            "Contains",
            "Delete",
            "GetBulkEndpoint",
        ]
        put = kv_cache.methods_by_name["Put"]
        assert put.input_type.full_name == "kvstash.v1.PutRequest"
        assert {field.name for field in put.input_type.fields} == {"key", "total_size", "data"}
        admin = pool.FindServiceByName("kvstash.v1.Admin")
        assert {method.name for method in admin.methods} == {"Stats", "ListKeys", "Info", "Evict", "Clear"}


def test_health_reports_serving_for_the_server_and_each_service(cache_server) -> None:
    with grpc.insecure_channel(cache_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvstash.v1.KVCache", "kvstash.v1.Admin"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        try:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.NOT_FOUND
        else:
            raise AssertionError("an unknown service must not be reported as healthy")
