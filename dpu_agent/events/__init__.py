"""The agent's event plane: job completions, status and telemetry over MQTT.

`MqttEventPublisher` (publisher.py) owns the broker connection and the backlog; the
wire format (topics and JSON) is `dpu_wire.events`, shared with the SDK.
"""

from dpu_agent.events.publisher import MqttEventPublisher, MqttSettings
from dpu_wire.events import TopicError

__all__ = ["MqttEventPublisher", "MqttSettings", "TopicError"]
