// Fetches each URL given on the command line, one after the other, with
// HttpURLConnection: the Java client that takes its proxy from the system properties
// (-Dhttp.proxyHost/-Dhttp.proxyPort, -Dhttps.proxyHost/-Dhttps.proxyPort) and its
// trusted CAs from the trust store. (java.net.http.HttpClient uses no proxy unless it
// is built with .proxy(ProxySelector.getDefault()).) Prints "<status> <body>" per URL.
// Run as a single source file: java Fetch.java URL...

import java.io.InputStream;
import java.net.HttpURLConnection;
import java.net.URI;
import java.nio.charset.StandardCharsets;

public class Fetch {
    public static void main(String[] args) throws Exception {
        for (String url : args) {
            HttpURLConnection connection =
                    (HttpURLConnection) URI.create(url).toURL().openConnection();
            int status = connection.getResponseCode();
            InputStream in =
                    status < 400 ? connection.getInputStream() : connection.getErrorStream();
            String body =
                    in == null ? "" : new String(in.readAllBytes(), StandardCharsets.UTF_8);
            System.out.println(status + " " + body);
        }
    }
}
