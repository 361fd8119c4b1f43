"""serving/ports.py: the ports a process hands out for its servers never repeat. With the socket
closed after each pick, the OS hands a port out again (2,000 binds of port 0 here gave 152 repeats),
which once put a test's OpenAI server on its own tritonserver's gRPC port."""
import socket

from serving.ports import free_port, free_ports


def test_ports_asked_one_at_a_time_never_repeat_and_each_is_free():
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports), f"{len(ports) - len(set(ports))} ports handed out twice"
    for port in ports[-3:]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when handed out


def test_ports_asked_together_differ_from_each_other_and_from_earlier_ones():
    earlier = free_port()
    group = free_ports(5)
    assert len(set(group)) == 5 and earlier not in group
