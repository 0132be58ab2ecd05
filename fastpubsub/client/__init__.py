"""The Python SDK: fastpubsub over HTTP, with batching publishers and managed subscribers.

```python
from fastpubsub.client import Client, Publisher, Subscriber

with Client("http://127.0.0.1:8000") as client:
    client.create_topic("orders")
    client.create_subscription("order-emails", "orders")
    with Publisher(client) as publisher:
        future = publisher.publish("orders", {"order_id": "12345"})
    print(future.result())  # the message id
```

`Client` and `AsyncClient` make every call of the HTTP API and return the
API's own models (fastpubsub.api.schemas); `Publisher`/`AsyncPublisher` batch;
`Subscriber`/`AsyncSubscriber` run callbacks with flow control and lease
extension. Importing this package loads httpx and pydantic, nothing of the
server. docs/client.md is the guide.
"""

from fastpubsub.api.schemas import (
    AckResults,
    ClientCreated,
    ClientOut,
    LeaseResults,
    MessageOut,
    MetricsOut,
    NackResults,
    PublishMessage,
    SeekResult,
    SubscriptionOut,
    TopicOut,
)
from fastpubsub.client.aio import (
    UNSET,
    AsyncClient,
    ClientOptions,
    PublishOptions,
    PushSettings,
    SubscriptionPolicies,
)
from fastpubsub.client.errors import (
    AlreadyExistsError,
    APIError,
    AuthenticationError,
    BacklogFullError,
    DatabaseUnavailableError,
    InvalidInputError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    ServerUnavailableError,
)
from fastpubsub.client.http import Retry
from fastpubsub.client.publisher import AsyncPublisher, Batching, Publisher, PublisherStats
from fastpubsub.client.subscriber import (
    AsyncSubscriber,
    Callback,
    ConsumeOptions,
    Consumer,
    ConsumerStats,
    Subscriber,
)
from fastpubsub.client.sync import Client
from fastpubsub.client.transports import Lease, PollTransport, StreamTransport, Transport, WebSocketTransport

Message = MessageOut
"""A consumed message: id, subscription_id, payload, attributes, priority, delivery_attempts, created_at."""

__all__ = [
    "UNSET",
    "APIError",
    "AckResults",
    "AlreadyExistsError",
    "AsyncClient",
    "AsyncPublisher",
    "AsyncSubscriber",
    "AuthenticationError",
    "BacklogFullError",
    "Batching",
    "Callback",
    "Client",
    "ClientCreated",
    "ClientOptions",
    "ClientOut",
    "ConsumeOptions",
    "Consumer",
    "ConsumerStats",
    "DatabaseUnavailableError",
    "InvalidInputError",
    "Lease",
    "LeaseResults",
    "Message",
    "MessageOut",
    "MetricsOut",
    "NackResults",
    "NotFoundError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "PollTransport",
    "PublishMessage",
    "PublishOptions",
    "Publisher",
    "PublisherStats",
    "PushSettings",
    "Retry",
    "SeekResult",
    "ServerUnavailableError",
    "StreamTransport",
    "Subscriber",
    "SubscriptionOut",
    "SubscriptionPolicies",
    "TopicOut",
    "Transport",
    "WebSocketTransport",
]
