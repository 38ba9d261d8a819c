// Prints the frames that RocketMQ's own Java classes (rocketmq-remoting 5.3.3, fetched by
// tests/rocketmq/pom.xml) encode for a handful of commands; test_codec.py holds the output
// (GOLDEN_*), so our encoder is checked byte for byte against the Java one.
// Run: java -cp 'tests/rocketmq/lib/*' tests/rocketmq_remoting/Golden.java
import java.nio.ByteBuffer;
import java.util.HexFormat;
import org.apache.rocketmq.remoting.protocol.LanguageCode;
import org.apache.rocketmq.remoting.protocol.RemotingCommand;
import org.apache.rocketmq.remoting.protocol.SerializeType;
import org.apache.rocketmq.remoting.protocol.header.GetMaxOffsetRequestHeader;
import org.apache.rocketmq.remoting.protocol.header.PullMessageRequestHeader;
import org.apache.rocketmq.remoting.protocol.header.SendMessageRequestHeaderV2;
import org.apache.rocketmq.remoting.protocol.header.namesrv.GetRouteInfoRequestHeader;

public class Golden {
    static void print(String name, RemotingCommand cmd) {
        ByteBuffer buf = cmd.encode();
        byte[] out = new byte[buf.remaining()];
        buf.get(out);
        System.out.println(name + " " + HexFormat.of().formatHex(out));
    }

    static RemotingCommand stamp(RemotingCommand cmd, int opaque) {
        cmd.setOpaque(opaque);
        cmd.setVersion(479);
        cmd.setLanguage(LanguageCode.PYTHON);
        return cmd;
    }

    public static void main(String[] args) {
        GetRouteInfoRequestHeader route = new GetRouteInfoRequestHeader();
        route.setTopic("lmqtt");
        route.setAcceptStandardJsonOnly(true);
        print("ROUTE", stamp(RemotingCommand.createRequestCommand(105, route), 7));

        SendMessageRequestHeaderV2 send = new SendMessageRequestHeaderV2();
        send.setA("lmqtt-producer");
        send.setB("mqtt");
        send.setC("TBW102");
        send.setD(4);
        send.setE(0);
        send.setF(0);
        send.setG(1764079200000L);
        send.setH(0);
        send.setI("INNER_MULTI_DISPATCH\u0001%LMQ%a,%LMQ%b\u0002WAIT\u0001true\u0002");
        send.setJ(0);
        send.setK(false);
        send.setM(false);
        RemotingCommand sendCmd = stamp(RemotingCommand.createRequestCommand(310, send), 8);
        sendCmd.setBody("hello".getBytes());
        print("SEND", sendCmd);

        PullMessageRequestHeader pull = new PullMessageRequestHeader();
        pull.setConsumerGroup("%LMQ%g1");
        pull.setTopic("%LMQ%a");
        pull.setQueueId(0);
        pull.setQueueOffset(42L);
        pull.setMaxMsgNums(32);
        pull.setSysFlag(6);
        pull.setCommitOffset(0L);
        pull.setSuspendTimeoutMillis(15000L);
        pull.setSubscription("*");
        pull.setSubVersion(0L);
        pull.setExpressionType("TAG");
        print("PULL", stamp(RemotingCommand.createRequestCommand(11, pull), 9));

        GetMaxOffsetRequestHeader max = new GetMaxOffsetRequestHeader();
        max.setTopic("%LMQ%a");
        max.setQueueId(0);
        RemotingCommand oneway = stamp(RemotingCommand.createRequestCommand(30, max), 10);
        oneway.markOnewayRPC();
        print("ONEWAY", oneway);

        RemotingCommand response = stamp(RemotingCommand.createResponseCommand(17, "topic[x] not exist, apply first please!"), 11);
        print("RESPONSE", response);

        RemotingCommand binary = stamp(RemotingCommand.createRequestCommand(310, send), 12);
        binary.setSerializeTypeCurrentRPC(SerializeType.ROCKETMQ);
        binary.setRemark("r\u00e9mark");
        binary.setBody("hello".getBytes());
        print("BINARY", binary);

        // What a producer's send frames carry (rocketmq_remoting/send_frames.py): no remark,
        // properties with a non-ASCII value.
        send.setI("INNER_MULTI_DISPATCH\u0001%LMQ%a,%LMQ%b\u0002WAIT\u0001false\u0002mqtt.topic\u0001t\u00f6/x\u0002");
        RemotingCommand binarySend = stamp(RemotingCommand.createRequestCommand(310, send), 13);
        binarySend.setSerializeTypeCurrentRPC(SerializeType.ROCKETMQ);
        binarySend.setBody("hello".getBytes());
        print("BINARY_SEND", binarySend);
    }
}
