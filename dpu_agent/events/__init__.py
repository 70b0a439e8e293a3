"""The agent's event plane: job completions, status and telemetry over MQTT.

`MqttEventPublisher` (publisher.py) owns the broker connection and the backlog;
payloads.py is the wire format (topics and JSON), with no I/O.
"""

from dpu_agent.events.payloads import TopicError
from dpu_agent.events.publisher import MqttEventPublisher, MqttSettings

__all__ = ["MqttEventPublisher", "MqttSettings", "TopicError"]
