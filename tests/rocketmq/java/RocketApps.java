/*
 * RocketMQ applications for the inbound / native-consumer tests, on the official Java client
 * (rocketmq-client 5.3.3 from Maven Central, in tests/rocketmq/lib with the broker's jars).
 * Compiled once per test session by tests/rocketmq/java_apps.py.
 *
 *   send NAMESRV TOPIC GROUP REPEAT INTERVAL_MS
 *       reads message specs from stdin, one a line: body TAB name=value TAB ...;
 *       sends each REPEAT times ("{i}" in the body and values replaced by 0..REPEAT-1), waiting
 *       INTERVAL_MS between sends; prints "SENT <msgId>" per message, "DONE" at the end
 *   filter NAMESRV TOPIC GROUP SQL92 EXPECT TIMEOUT_S
 *       a DefaultLitePullConsumer on TOPIC with a SQL92 property filter, from the first offset;
 *       prints "GOT <mqtt.topic> <body>" per message until EXPECT arrived (or the timeout)
 */
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import org.apache.rocketmq.client.consumer.DefaultLitePullConsumer;
import org.apache.rocketmq.client.consumer.MessageSelector;
import org.apache.rocketmq.client.producer.DefaultMQProducer;
import org.apache.rocketmq.client.producer.SendResult;
import org.apache.rocketmq.common.consumer.ConsumeFromWhere;
import org.apache.rocketmq.common.message.Message;
import org.apache.rocketmq.common.message.MessageExt;

public class RocketApps {
    static final int TIMEOUT_MS = 20000;

    public static void main(String[] args) throws Exception {
        switch (args[0]) {
            case "send": send(args); break;
            case "filter": filter(args); break;
            default: throw new IllegalArgumentException(args[0]);
        }
    }

    static void send(String[] args) throws Exception {
        String namesrv = args[1], topic = args[2], group = args[3];
        int repeat = Integer.parseInt(args[4]);
        long interval = Long.parseLong(args[5]);
        List<String[]> specs = new ArrayList<>();
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        for (String line; (line = in.readLine()) != null; ) {
            if (!line.isEmpty()) specs.add(line.split("\t"));
        }
        DefaultMQProducer producer = new DefaultMQProducer(group);
        producer.setNamesrvAddr(namesrv);
        // A loaded shared test host: seconds, not the default 3 s, for a route or a send.
        producer.setMqClientApiTimeout(TIMEOUT_MS);
        producer.setSendMsgTimeout(TIMEOUT_MS);
        producer.start();
        try {
            for (int i = 0; i < repeat; i++) {
                for (String[] spec : specs) {
                    String n = Integer.toString(i);
                    Message msg = new Message(topic, spec[0].replace("{i}", n).getBytes(StandardCharsets.UTF_8));
                    for (int k = 1; k < spec.length; k++) {
                        int eq = spec[k].indexOf('=');
                        msg.putUserProperty(spec[k].substring(0, eq), spec[k].substring(eq + 1).replace("{i}", n));
                    }
                    SendResult result = producer.send(msg);
                    System.out.println("SENT " + result.getMsgId() + " " + result.getSendStatus());
                    System.out.flush();
                    if (interval > 0) Thread.sleep(interval);
                }
            }
        } finally {
            producer.shutdown();
        }
        System.out.println("DONE");
    }

    static void filter(String[] args) throws Exception {
        String namesrv = args[1], topic = args[2], group = args[3], sql = args[4];
        int expect = Integer.parseInt(args[5]);
        long deadline = System.currentTimeMillis() + 1000L * Long.parseLong(args[6]);
        DefaultLitePullConsumer consumer = new DefaultLitePullConsumer(group);
        consumer.setNamesrvAddr(namesrv);
        consumer.setMqClientApiTimeout(TIMEOUT_MS);
        consumer.setConsumeFromWhere(ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET);
        consumer.subscribe(topic, MessageSelector.bySql(sql));
        consumer.start();
        int got = 0;
        try {
            while (got < expect && System.currentTimeMillis() < deadline) {
                for (MessageExt m : consumer.poll(1000)) {
                    System.out.println("GOT " + m.getProperty("mqtt.topic") + " "
                        + new String(m.getBody(), StandardCharsets.UTF_8));
                    got++;
                }
                System.out.flush();
            }
        } finally {
            consumer.shutdown();
        }
        System.out.println("DONE");
    }
}
